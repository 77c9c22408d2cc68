"""GPU tests of attention's key splits merged by the output projection (``KeySplits``):
the attention kernel's unmerged partials merge to its output; the projection that
merges them as it loads its rows matches the projection of the merged rows, in and out
of a graph; a decode step at SmolLM2's shape runs no merge kernel at one row and still
one at eight, and at the 1.5 B shape keeps it (``gemm_launch.merges_splits``)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
HEADS, KV_HEADS, D = 9, 3, 64  # SmolLM2-135M's attention


def _attention_case(n: int = 1, pos: tuple[int, ...] = (300,)):
    bs, blocks = 16, 80
    k_cache = torch.randn(blocks, bs, KV_HEADS, D, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(blocks - 1, device=DEVICE)[: n * 20].view(n, 20) + 1).int()
    positions = torch.tensor(pos, device=DEVICE)
    q = torch.randn(n, HEADS, D, device=DEVICE, dtype=torch.bfloat16)
    req = torch.arange(n, device=DEVICE, dtype=torch.int32)
    return q, k_cache, v_cache, positions, req, tables


@pytest.mark.parametrize("pos", [(300,), (5,), (-1,), (40, -1)])
def test_attention_left_unmerged_merges_to_its_output(pos):
    from ostinato.engine.kernels.attention_launch import KeySplits
    from ostinato.engine.kernels.paged_attention import paged_attention

    args = _attention_case(len(pos), pos)
    want = paged_attention(*args, D**-0.5, splits=16)
    splits = KeySplits.empty(len(pos), HEADS, 16, D, DEVICE)
    out = torch.full_like(want, 7.0)
    paged_attention(*args, D**-0.5, out=out, key_splits=splits)
    assert torch.equal(out, torch.full_like(want, 7.0))  # not written
    got = splits.merged(want.dtype).view_as(want)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    if pos[0] < 0:
        assert not got.any()  # a padding row's output is zeros


def _projection_case(seed: int = 0):
    from ostinato.engine.kernels.attention_launch import KeySplits
    from ostinato.engine.kernels.gemm_launch import CONFIGS, resident_config

    torch.manual_seed(seed)
    k = n = HEADS * D
    splits = KeySplits.empty(1, HEADS, 16, D, DEVICE)
    splits.partial.normal_()
    splits.m.normal_()
    splits.l_sum.uniform_(0.5, 2.0)
    splits.m[:, :, 9:] = float("-inf")  # empty splits, as attention leaves them
    splits.l_sum[:, :, 9:] = 0.0
    splits.partial[:, :, 9:] = 0.0
    weight = 0.05 * torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    config = CONFIGS[resident_config(k, 1, weight.numel() * 2, 1) - 1]
    return splits, weight, config


def _merging_projection(splits, weight, config, counters, out_rows, residual, stats):
    from ostinato.engine.kernels import small_gemm as tg

    after = tg.ResidualStats(residual, stats)
    return tg.small_gemm(
        out_rows, weight, None, counters, config, False, True, None, after, merge=splits
    )


def test_the_projection_merging_the_splits_matches_the_projection_of_the_merged_rows():
    from ostinato.engine.kernels import small_gemm as tg
    from ostinato.engine.kernels.gemm_launch import MAX_ROWS, merges_splits, stats_columns

    splits, weight, config = _projection_case()
    k = n = weight.shape[0]
    assert merges_splits(config, 1, k, n, 16)
    counters = torch.zeros(tg.counters_needed(n), dtype=torch.int32, device=DEVICE)
    rows = torch.empty(1, k, device=DEVICE, dtype=torch.bfloat16)  # never read
    residual = torch.randn(1, n, device=DEVICE, dtype=torch.bfloat16)
    stats = torch.zeros(MAX_ROWS, stats_columns(n), device=DEVICE)
    got = _merging_projection(splits, weight, config, counters, rows, residual, stats)
    merged = splits.merged(torch.bfloat16)
    stats_want = torch.zeros_like(stats)
    after = tg.ResidualStats(residual, stats_want)
    want = tg.small_gemm(merged, weight, None, counters, config, False, True, None, after)
    # the splits are summed in another order than torch's merge: a rounding apart
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    exact = merged.float() @ weight.float().T
    assert ((got.float() - exact).norm() / exact.norm()).item() < 1e-2
    torch.testing.assert_close(stats, stats_want, atol=1e-2, rtol=2e-2)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = _merging_projection(splits, weight, config, counters, rows, residual, stats)
    for seed in range(3):
        fresh, _, _ = _projection_case(10 + seed)
        for name in ("partial", "m", "l_sum"):
            getattr(splits, name).copy_(getattr(fresh, name))
        graph.replay()
        eager = _merging_projection(splits, weight, config, counters, rows, residual, stats)
        assert torch.equal(replayed, eager)
    assert counters.count_nonzero() == 0


def test_a_projection_that_cannot_merge_the_splits_refuses_them():
    from ostinato.engine.kernels import small_gemm as tg
    from ostinato.engine.kernels.gemm_launch import CONFIGS

    splits, weight, _ = _projection_case()
    k = weight.shape[1]
    counters = torch.zeros(tg.counters_needed(k), dtype=torch.int32, device=DEVICE)
    rows = torch.empty(1, k, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not merge 16 key splits"):
        tg.small_gemm(rows, weight, None, counters, CONFIGS[0], merge=splits)  # a K loop


@pytest.mark.parametrize(
    "shape, batch, merges", [("smollm2", 1, True), ("smollm2", 8, False), ("llama-1.5b", 1, False)]
)
def test_a_decode_step_runs_the_merge_kernel_only_where_the_projection_cannot(shape, batch, merges):
    # The step replayed is bitwise its eager run (the same kernels), and agrees with the
    # layers run unfused (attention's own merge kernel, cuBLAS's projections) on the
    # same weights and cache to bf16's summation-order differences.
    from dataclasses import replace

    from benchmarks.census import kernel_census
    from benchmarks.decode import SMOLLM2_CONFIG, BenchConfig, DecodeSetup, model_config
    from ostinato.engine import KernelOptions
    from ostinato.modes import GraphMode

    model = model_config(SMOLLM2_CONFIG if shape == "smollm2" else shape)
    cfg = replace(BenchConfig(model=model), batch_sizes=(batch,), kv_len=300)
    setup = DecodeSetup(cfg, DEVICE)
    step = setup.decode_batch(list(range(3, 3 + batch)))
    unfused = KernelOptions(fused_layers=False)
    logits = {}
    for name, mode, kernels in (
        ("eager", GraphMode.NONE, None),
        ("graph", GraphMode.FULL, None),
        ("unfused", GraphMode.FULL, unfused),
    ):
        runner = setup.runner(mode, None, kernels=kernels)
        with torch.inference_mode():
            runner.capture()
            logits[name] = runner.execute(step).logits.float().clone()
            if name == "graph":
                census = kernel_census(setup.decode_step(runner, batch))
        runner.release()
    names = [k.name for k in census.by_name]
    assert ("_merge_splits_kernel" not in names) == merges, names
    assert torch.equal(logits["eager"], logits["graph"])
    err = (logits["graph"] - logits["unfused"]).norm() / logits["unfused"].norm()
    assert err.item() < 3e-2, err.item()
