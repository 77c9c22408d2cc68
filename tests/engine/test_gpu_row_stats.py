"""GPU tests of the row statistics the small GEMM hands to the next norm
(``ResidualStats`` out of a plain projection, ``NormPrologue.stats`` into a normed one):
the sums of squares against torch's, and the normed projections taking them against the
same projections summing their rows themselves."""

import pytest
import torch
from gpu_harness import row_stats_of, stats_rows

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
BF = dict(device=DEVICE, dtype=torch.bfloat16)
# (K, N) of the projections that hand statistics on: O and down at the SmolLM2 and
# Llama-3.2-1B shapes, and a width that is not a whole number of 64-column tiles
PROJECTIONS = [(576, 576), (1536, 576), (2048, 2048), (8192, 2048), (256, 80)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("k, n", PROJECTIONS)
@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("config", [(32, 1), (64, 1), (32, 4), (64, 8), "resident"])
@pytest.mark.parametrize("add", [False, True])
def test_a_projection_stores_the_row_statistics_of_its_sum_with_the_residual(k, n, m, config, add):
    from ostinato.engine.kernels import small_gemm as tg
    from ostinato.engine.kernels.gemm_launch import resident_config
    from ostinato.engine.kernels.launch_rules import rules

    if config == "resident":
        if m > rules().resident_max_rows:
            pytest.skip(f"a resident launch takes at most {rules().resident_max_rows} rows")
        config = tg.CONFIGS[resident_config(k) - 1]
    else:
        config = tg.GemmConfig(*config)

    torch.manual_seed(m + n)
    x, w = torch.randn(m, k, **BF), torch.randn(n, k, **BF) / k**0.5
    b = 0.1 * torch.randn(n, **BF)
    residual = torch.randn(m, n, **BF)
    stats = torch.full((tg.MAX_ROWS, tg.stats_columns(n)), float("nan"), device=DEVICE)
    counters = torch.zeros(tg.counters_needed(n), dtype=torch.int32, device=DEVICE)
    after = tg.ResidualStats(residual, stats, add)
    got = tg.small_gemm(x, w, b, counters, config, False, True, None, after)
    plain = tg.small_gemm(x, w, b, counters, config, False, True)
    total = plain + residual  # torch's add: rounded as the kernel rounds
    assert torch.equal(got, total if add else plain)
    torch.testing.assert_close(stats_rows(stats, m, n), row_stats_of(total), rtol=1e-5, atol=1e-3)
    assert counters.count_nonzero() == 0


@pytest.mark.parametrize("hidden, inter", [(576, 1536), (2048, 8192)])
@pytest.mark.parametrize(
    "m, resident", [(1, False), (1, True), (2, False), (2, True), (7, False), (16, False)]
)
@pytest.mark.parametrize("add", [False, True])
def test_a_normed_projection_takes_its_sums_of_squares_from_the_statistics(
    hidden, inter, m, resident, add
):
    from ostinato.engine.kernels import small_gemm as tg
    from ostinato.engine.kernels.gemm_launch import pick_config, resident_config
    from ostinato.engine.kernels.launch import num_sms

    torch.manual_seed(m)
    x, residual = torch.randn(m, hidden, **BF), torch.randn(m, hidden, **BF)
    h = x + residual
    norm_w = 1 + 0.1 * torch.randn(hidden, **BF)
    w = torch.randn(2 * inter, hidden, **BF) / hidden**0.5
    stats = torch.zeros(tg.MAX_ROWS, tg.stats_columns(hidden), device=DEVICE)
    stats_rows(stats, m, hidden).copy_(row_stats_of(h))
    counters = torch.zeros(tg.counters_needed(2 * inter), dtype=torch.int32, device=DEVICE)
    choice = pick_config(inter, hidden, num_sms(DEVICE), swiglu=True)
    config = tg.CONFIGS[(resident_config(hidden, tiles=2) if resident else choice) - 1]
    total, want_total = torch.empty_like(x), torch.empty_like(x)
    prologue = tg.NormPrologue(norm_w, 1e-5, residual, want_total)
    want = tg.small_gemm(x, w, None, counters, config, True, True, prologue)
    if add:
        norm = tg.NormPrologue(norm_w, 1e-5, residual, total, stats)
        got = tg.small_gemm(x, w, None, counters, config, True, True, norm)
        assert torch.equal(total, want_total)
    else:
        norm = tg.NormPrologue(norm_w, 1e-5, stats=stats)
        got = tg.small_gemm(h, w, None, counters, config, True, True, norm)
    # the squares summed in another order: rstd may differ in its last bits, and a
    # normed value then round the other way
    assert rel_err(got, want) < 2e-3
    assert counters.count_nonzero() == 0


def test_statistics_of_the_wrong_shape_are_refused():
    from ostinato.engine.kernels import small_gemm as tg

    x, w = torch.randn(2, 64, **BF), torch.randn(64, 64, **BF)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    bad = tg.ResidualStats(torch.randn(2, 64, **BF), torch.zeros(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="row statistics must be float32"):
        tg.small_gemm(x, w, None, counters, tg.GemmConfig(32, 1), after=bad)
