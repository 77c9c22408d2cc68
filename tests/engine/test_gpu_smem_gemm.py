"""GPU tests of the small GEMM's shared-memory launch (``smem_gemm``, 3 to 8 rows): its
products against float32 and against the K loop's launch of the same projection, with
every prologue and epilogue it takes (the norm, with and without a residual and row
statistics; the bias; the row statistics out, with and without the sum), in and out of
a graph, and the launch the default plan picks. Its SwiGLU and RoPE epilogues are tested
with the fused layers' (``test_gpu_fused_layers``)."""

import pytest
import torch
from gpu_harness import row_stats_of, stats_rows

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
BF = dict(device=DEVICE, dtype=torch.bfloat16)
# (K, N): SmolLM2's O, down and QKV, the 1.5 B shape's O, a width not a whole number of
# 16-column tiles, a K of 16-column steps (576 = 4 warps x 144)
SHAPES = [(576, 576), (1536, 576), (576, 960), (2048, 2048), (256, 72)]
ROWS = [3, 5, 8]


def smem():
    from ostinato.engine.kernels import gemm_launch as g

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the shared-memory launch is measured and tested on Hopper")
    return g.CONFIGS[-1]


def k_loop(n: int, k: int):
    from ostinato.engine.kernels import gemm_launch as g
    from ostinato.engine.kernels.launch import num_sms

    return g.CONFIGS[g.pick_config(n, k, num_sms(DEVICE)) - 1]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_as_close_to_float32_as_the_k_loop(k, n, m, bias):
    from ostinato.engine.kernels import small_gemm as tg

    config = smem()
    assert tg.fits(config, m, k)
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k, **BF), torch.randn(n, k, **BF) / k**0.5
    b = torch.randn(n, **BF) if bias else None
    counters = torch.zeros(tg.counters_needed(n), dtype=torch.int32, device=DEVICE)
    want = x.float() @ w.float().T + (b.float() if bias else 0)
    got = tg.small_gemm(x, w, b, counters, config, pdl=True)
    loop = tg.small_gemm(x, w, b, counters, k_loop(n, k), pdl=True)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < max(2 * rel_err(loop, want), 4e-3)


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", [3, 8])
@pytest.mark.parametrize("add", [False, True])
def test_the_row_statistics_out_are_those_of_the_sum_with_the_residual(k, n, m, add):
    from ostinato.engine.kernels import small_gemm as tg

    config = smem()
    torch.manual_seed(m + n)
    x, w = torch.randn(m, k, **BF), torch.randn(n, k, **BF) / k**0.5
    b, residual = 0.1 * torch.randn(n, **BF), torch.randn(m, n, **BF)
    stats = torch.full((tg.MAX_ROWS, tg.stats_columns(n)), float("nan"), device=DEVICE)
    counters = torch.zeros(tg.counters_needed(n), dtype=torch.int32, device=DEVICE)
    after = tg.ResidualStats(residual, stats, add)
    got = tg.small_gemm(x, w, b, counters, config, False, True, None, after)
    plain = tg.small_gemm(x, w, b, counters, config, False, True)
    total = plain + residual  # torch's add: rounded as the kernel rounds
    assert torch.equal(got, total if add else plain)
    torch.testing.assert_close(stats_rows(stats, m, n), row_stats_of(total), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("k, n", [(576, 576), (2048, 2048), (1536, 72)])
@pytest.mark.parametrize("m", [3, 8])
@pytest.mark.parametrize("residual, read_stats", [(False, False), (True, False), (True, True)])
def test_the_norm_prologue_norms_as_the_k_loop_does(k, n, m, residual, read_stats):
    from ostinato.engine.kernels import small_gemm as tg

    config = smem()
    torch.manual_seed(m + k)
    x, w = torch.randn(m, k, **BF), torch.randn(n, k, **BF) / k**0.5
    norm_w = 1 + 0.1 * torch.randn(k, **BF)
    res = torch.randn(m, k, **BF) if residual else None
    h = x + res if residual else x
    stats = None
    if read_stats:
        stats = torch.zeros(tg.MAX_ROWS, tg.stats_columns(k), device=DEVICE)
        stats_rows(stats, m, k).copy_(row_stats_of(h))
    counters = torch.zeros(tg.counters_needed(n), dtype=torch.int32, device=DEVICE)
    total, loop_total = torch.empty_like(x), torch.empty_like(x)
    got = tg.small_gemm(
        x, w, None, counters, config, pdl=True,
        norm=tg.NormPrologue(norm_w, 1e-5, res, total if residual else None, stats),
    )  # fmt: skip
    loop = tg.small_gemm(
        x, w, None, counters, k_loop(n, k), pdl=True,
        norm=tg.NormPrologue(norm_w, 1e-5, res, loop_total if residual else None),
    )  # fmt: skip
    if residual:
        assert torch.equal(total, h)
    # the normed rows may differ in a last bit (sums of squares in another order)
    want = torch.nn.functional.rms_norm(h.float(), (k,), norm_w.float(), 1e-5) @ w.float().T
    assert rel_err(got, want) < max(2 * rel_err(loop, want), 4e-3)


def test_a_graph_replays_the_launch_bitwise_on_new_rows():
    from ostinato.engine.kernels import small_gemm as tg

    config = smem()
    k, n, m = 2048, 2048, 8
    torch.manual_seed(0)
    w = torch.randn(n, k, **BF) / k**0.5
    src, x = torch.randn(m, k, **BF), torch.empty(m, k, **BF)
    residual = torch.randn(m, n, **BF)
    stats = torch.zeros(tg.MAX_ROWS, tg.stats_columns(n), device=DEVICE)
    counters = torch.zeros(tg.counters_needed(n), dtype=torch.int32, device=DEVICE)

    def step():
        x.copy_(src)  # a kernel that writes the rows, then the launch waits for it (PDL)
        after = tg.ResidualStats(residual, stats, True)
        return tg.small_gemm(x, w, None, counters, config, False, True, None, after)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        src.copy_(torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(**BF))
        graph.replay()
        got, got_stats = out.clone(), stats.clone()
        want = step()
        torch.cuda.synchronize()
        assert torch.equal(got, want) and torch.equal(got_stats, stats)


def test_the_default_plan_takes_the_launch_where_its_tiles_and_the_weight_fit():
    from ostinato.engine.kernels import gemm_launch as g
    from ostinato.engine.worker.gemm_tuning import _default_plan

    smem()
    # SmolLM2's O and gate/up, the 1.5 B shape's O, down and gate/up (67 MB, over
    # LaunchRules.smem_max_bytes however many tiles a program may hold)
    for k, n in ((576, 576), (576, 1536), (2048, 2048), (8192, 2048), (2048, 8192)):
        w, w2 = torch.empty(n, k, **BF), torch.empty(2 * n, k, **BF)
        plan, swiglu = _default_plan(w, False), _default_plan(w2, True)
        for m in range(1, g.MAX_ROWS + 1):
            plain_fits = g.smem_config(k, 1, m, n * k * 2) is not None
            assert g.CONFIGS[plan[m] - 1].smem == plain_fits, (k, m)
            swiglu_fits = g.smem_config(k, 2, m, 2 * n * k * 2) is not None
            assert g.CONFIGS[swiglu[m] - 1].smem == swiglu_fits, (k, m)
            assert not swiglu_fits  # two tiles: not by default (LaunchRules.smem_max_tiles)
    assert g.smem_config(8192, 1, 8) is None  # the 1.5 B down: 512 KiB of tiles a program
    assert g.fits(g.CONFIGS[-1], 8, 2048, 2)  # its gate/up's tiles fit a program
