"""Fused decoder layers (``KernelOptions.fused_layers``, on by default) on the CPU: the two
norm-then-projection ops compute what the unfused layer computes, to the bit, in every
placement of RoPE and through torch.compile; the launch shapes chosen without a
measurement are the ones their rule names (checked against brute force)."""

from dataclasses import replace
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hf_models import write_checkpoint
from torch._inductor.utils import fresh_inductor_cache

from benchmarks.decode import BenchConfig, DecodeSetup
from ostinato.batch import BatchDescriptor
from ostinato.engine import LLM, KernelOptions, SamplingParams
from ostinato.engine.core.scheduler import ScheduledBatch
from ostinato.engine.kernels.gemm_launch import (
    CONFIGS,
    MAX_ROWS,
    MAX_SPLIT_K,
    GemmConfig,
    pick_config,
    rope_split_k,
    working_splits,
)
from ostinato.engine.kernels.launch_rules import LaunchRules, rules, rules_in_force
from ostinato.engine.model import decoder, fused_ops
from ostinato.engine.model.attention import TorchAttention
from ostinato.engine.model.presets import shape
from ostinato.engine.worker.runner import ModelRunner
from ostinato.mathutil import ceil_div
from ostinato.modes import GraphMode

PROMPTS = [[(7 * i + 2) % 89 + 3 for i in range(37)], [4, 9, 16, 25]]
UNFUSED = KernelOptions(fused_layers=False)


def _tiny_decode() -> tuple[DecodeSetup, ScheduledBatch]:
    """The tiny model's benchmark setup on the CPU (float32, KV 40) and a decode step of
    four requests in it."""
    cfg = replace(BenchConfig(model=shape("tiny")), batch_sizes=(4,), kv_len=40, dtype="float32")
    setup = DecodeSetup(cfg, torch.device("cpu"))
    return setup, setup.decode_batch([3, 5, 7, 11])


def _tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("rope_in_backend", [False, True])
def test_fused_and_unfused_layers_generate_the_same_tokens(rope_in_backend):
    kw = dict(device="cpu", dtype=torch.float32, max_model_len=96, progress=False)
    backend = TorchAttention(applies_rope=rope_in_backend)
    fused = LLM("tiny", backend=backend, **kw)
    assert all(layer.fused for layer in fused.engine.model.layers)  # the default
    unfused = LLM(
        "tiny", backend=TorchAttention(applies_rope=rope_in_backend), kernels=UNFUSED, **kw
    )
    assert not any(layer.fused for layer in unfused.engine.model.layers)
    assert _tokens(fused) == _tokens(unfused)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_fused_layers_keep_qkv_biases_and_head_norms(arch, tmp_path):
    # Qwen2 has QKV biases, Qwen3 per-head q/k norms: both inside ostinato::norm_qkv.
    write_checkpoint(arch, tmp_path)
    kw = dict(device="cpu", dtype=torch.float32, max_model_len=96, progress=False)
    fused = LLM(str(tmp_path), **kw)
    assert _tokens(fused) == _tokens(LLM(str(tmp_path), kernels=UNFUSED, **kw))


@pytest.mark.parametrize("compiler", [None, "inductor"])
@pytest.mark.parametrize("row_stats", [True, False])
def test_a_fused_decode_step_is_the_unfused_one(compiler, row_stats):
    # Eagerly the fused ops run the unfused ops (the CPU has no fused kernel): the same
    # bits, with the row statistics handed on (the default on one device) or not (as
    # under tensor parallelism). Compiled, both run the layers unfused; Inductor's own
    # kernels may round differently from eager torch, hence a tolerance there.
    setup, step = _tiny_decode()
    logits = []
    for kernels in (KernelOptions(), UNFUSED):
        with rules_in_force(LaunchRules(row_stats=row_stats)):
            runner = setup.runner(GraphMode.NONE, compiler, TorchAttention(), kernels)
        assert all(layer.fused == kernels.fused_layers for layer in runner.model.layers)
        hands = row_stats and kernels.fused_layers
        assert all(layer.mlp.row_stats == hands for layer in runner.model.layers)
        with torch.inference_mode():
            runner.compile()
            logits.append(runner.execute(step).logits.clone())
        runner.release()
    if compiler is None:
        assert torch.equal(logits[0], logits[1])
    else:
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiler", [None, "inductor"])
def test_compiled_layers_run_unfused_and_the_eager_model_fused(compiler):
    # The fused QKV op is a splitting op: compiled (the piecewise graphs of prefills and
    # mixed steps) the layers must not call it, or its norm and projection would run
    # between the graphs at every size. Eagerly (what FULL decode graphs capture) they do.
    setup, step = _tiny_decode()
    runner = setup.runner(GraphMode.NONE, compiler, TorchAttention(), KernelOptions())
    with (
        mock.patch.object(fused_ops, "_norm_into", wraps=fused_ops._norm_into) as norms,
        torch.inference_mode(),
    ):
        runner.compile()
        norms.reset_mock()
        runner.execute(step)
    runner.release()
    layers = len(runner.model.layers)
    assert norms.call_count == (0 if compiler else layers), norms.call_count


@pytest.mark.parametrize(("fused", "planned_head"), [(True, True), (True, False), (False, True)])
def test_a_fused_decode_step_runs_its_norms_inside_the_projections_ops(fused, planned_head):
    # DecoderModel.logits: with fused layers every norm of a decode step is inside the
    # op of the projection after it (on CUDA, its kernel); the final one too where the
    # LM head has a plan, else it runs before cuBLAS's LM head, which writes in place.
    setup, step = _tiny_decode()
    runner = setup.runner(GraphMode.NONE, None, TorchAttention(), KernelOptions(fused_layers=fused))
    add = decoder.RMSNorm.add
    with (
        mock.patch.object(decoder.RMSNorm, "add", autospec=True, side_effect=add) as adds,
        torch.inference_mode(),
    ):
        runner.compile()
        if planned_head:
            runner.model.lm_head.use_plan((0, 1, 1, 1, 1), 4, False)
        runner.execute(step)
    runner.model.lm_head.use_plan((), 0, False)
    runner.release()
    layers = len(runner.model.layers)
    want = 2 * layers if not fused else 0 if planned_head else 1
    assert adds.call_count == want, adds.call_count


@pytest.mark.parametrize(
    "mode", [GraphMode.FULL_AND_PIECEWISE, GraphMode.FULL, GraphMode.PIECEWISE, GraphMode.NONE]
)
@pytest.mark.parametrize("fused", [True, False])
def test_a_step_runs_the_eager_model_exactly_where_its_full_graph_takes_fused_kernels(mode, fused):
    runner = SimpleNamespace(kernels=KernelOptions(fused_layers=fused))
    for rows in range(1, 3 * MAX_ROWS):
        for uniform in (True, False):
            d = BatchDescriptor(rows, rows if uniform else None, uniform)
            full = {
                GraphMode.FULL: True,
                GraphMode.FULL_AND_PIECEWISE: uniform,
            }.get(mode, False)
            want = fused and full and rows <= MAX_ROWS
            assert ModelRunner._fused_eagerly(runner, d, mode) == want, (mode, rows, uniform)


def test_the_fused_ops_refuse_a_mismatched_residual():
    from ostinato.engine.model.fused_ops import norm_linear

    x, w = torch.randn(3, 8), torch.randn(12, 8)
    with pytest.raises(ValueError, match="must match"):
        norm_linear(x, torch.randn(3, 4), torch.ones(8), 1e-6, w, torch.zeros(0), [], True)


@pytest.mark.parametrize("swiglu, residual", [(True, True), (False, True), (False, False)])
def test_the_norm_linear_op_compiled_equals_it_eager(swiglu, residual):
    # The compiled model does not call the fused ops, but they stay traceable: their
    # fake implementations must describe the real outputs for compiled callers.
    def f(x, residual, norm_weight, weight):
        out, total = torch.ops.ostinato.norm_linear(
            x, residual, norm_weight, 1e-6, weight, torch.zeros(0, dtype=torch.int32), [],
            swiglu,
        )  # fmt: skip
        return out * 2, total + 1

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(shape, generator=g) for shape in ((5, 16), (5, 16), (16,), (24, 16))]
    if not residual:
        args[1] = None
    want = f(*args)
    # A fresh cache: Inductor's on-disk cache keys do not cover the fake implementation.
    with fresh_inductor_cache():
        got = torch.compile(f, backend="inductor", fullgraph=True)(*args)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_config_chosen_without_a_measurement_follows_its_rule():
    from ostinato.engine.kernels.gemm_launch import (
        BLOCK_K,
        SPLIT_K_COLUMNS,
        UNSPLIT_K,
        k_per_split,
        k_step,
    )

    for sms in (16, 78, 132):
        for n in (64, 576, 1536, 2048, 3072, 8192, 49152):
            for k in (64, 576, 1024, 1536, 2048, 8192, 14336):
                c = CONFIGS[pick_config(n, k, sms) - 1]
                if 2 * ceil_div(n, 64) >= sms:  # wide enough unsplit
                    assert (c.block_n, c.split_k, c.num_warps) == (64, 1, 8), (n, k, sms)
                    continue
                if k <= UNSPLIT_K:
                    assert c.split_k == 1
                else:  # the fewest splits of at most SPLIT_K_COLUMNS, or the most allowed
                    short = k_per_split(k, c.split_k) <= SPLIT_K_COLUMNS
                    assert short or c.split_k == MAX_SPLIT_K
                    assert c.split_k == 1 or k_per_split(k, c.split_k // 2) > SPLIT_K_COLUMNS
                programs = ceil_div(n, 32) * working_splits(k, c.split_k)
                assert c.block_n == (64 if programs > 2 * sms else 32), (n, k, sms)
                assert c.num_warps == 4
                assert c.block_k == k_step(k, c.split_k), (n, k, sms)
                # all of an unsplit narrow tile's 128-column steps in flight
                deep = (c.block_n, c.split_k, c.block_k) == (32, 1, BLOCK_K)
                assert c.num_stages == (rules().unsplit_stages if deep else 3), (n, k, sms)


def test_only_long_whole_splits_step_256_columns():
    from ostinato.engine.kernels.gemm_launch import BLOCK_K, k_per_split, k_step

    long_split_k = rules().long_split_k

    for k in range(64, 16385, 64):
        for split in (1, 2, 4, 8):
            per = k_per_split(k, split)
            step = k_step(k, split)
            assert step in (BLOCK_K, 256)
            # 256 exactly where a split is long and whole 256-column steps cover it, so
            # the longer step reads no more padding than the shorter one.
            assert (step == 256) == (per >= long_split_k and per % 256 == 0), (k, split)
            assert k_per_split(k, split, step) == per
    # The 1.5 B shape's splits step 256, SmolLM2's keep 128 (what the H200 sweep showed).
    assert [k_step(2048, 4), k_step(8192, 8)] == [256, 256]
    assert [k_step(576, 1), k_step(576, 8), k_step(1536, 4)] == [BLOCK_K] * 3


def test_an_unsplit_gate_up_steps_further_in_narrow_tiles():
    from ostinato.engine.kernels.gemm_launch import SWIGLU_BLOCK_K

    for sms in (16, 78, 132):
        for n in (64, 576, 1536, 2048, 3072, 8192, 49152):
            for k in (64, 576, 1024, 1536, 2048, 8192, 14336):
                plain = CONFIGS[pick_config(n, k, sms) - 1]
                swiglu = CONFIGS[pick_config(n, k, sms, swiglu=True) - 1]
                same = (swiglu.block_n, swiglu.split_k, swiglu.num_warps, swiglu.num_stages)
                if 2 * ceil_div(n, 64) >= sms:  # wide: 32-column tiles, not the 64 of plain
                    assert (plain.block_n, plain.num_warps) == (64, 8)
                    assert same == (32, 1, 4, plain.num_stages), (n, k, sms)
                else:  # the plain tile and splits, in 3 stages
                    kept = (plain.block_n, plain.split_k, plain.num_warps, 3)
                    assert same == kept, (n, k, sms)
                want = SWIGLU_BLOCK_K if plain.split_k == 1 else plain.block_k
                assert swiglu.block_k == want, (n, k, sms)
    # Cached plans name configs by index: the first twelve keep their places.
    assert CONFIGS[8] == GemmConfig(64, 1, num_warps=8) and CONFIGS[0] == GemmConfig(32, 1)
    assert CONFIGS[11] == GemmConfig(64, 1, num_warps=8, block_k=SWIGLU_BLOCK_K)


def test_the_qkv_split_covers_the_gpu_when_splits_can():
    for sms in (16, 132):
        for heads in (3, 15, 48, 96, 200):
            for k in (64, 576, 2048, 4096):
                split = rope_split_k(heads, k, sms)
                assert split & (split - 1) == 0 and 1 <= split <= MAX_SPLIT_K
                covered = heads * working_splits(k, split) >= sms
                more = split < MAX_SPLIT_K and working_splits(k, 2 * split) > working_splits(
                    k, split
                )
                assert covered or not more, (heads, k, sms, split)
                if split > 1:  # never more splits than needed
                    assert heads * working_splits(k, split // 2) < sms


def test_a_resident_launch_is_for_few_rows_and_weights_a_program_can_hold():
    from ostinato.engine.kernels import gemm_launch as g

    resident_rows = rules().resident_max_rows
    # cached plans name configs by index: the resident shapes come after every other
    # but the shared-memory one
    assert [c.resident for c in CONFIGS[-3:]] == [True, True, False]
    assert not any(c.resident for c in CONFIGS[:-3])
    for k in range(1, 20000, 97):
        for tiles in (1, 2):
            held = tiles * g.RESIDENT_N * triton_p2(k)
            choice = g.resident_config(k, tiles)
            if held > g.RESIDENT_ELEMENTS:
                assert choice is None
                continue
            c = CONFIGS[choice - 1]
            assert c.resident and c.block_n == g.RESIDENT_N
            assert c.num_warps == (8 if held > rules().resident_wide else 4)
            assert g.fits(c, 1, k, tiles) and g.fits(c, resident_rows, k, tiles)
            assert not g.fits(c, resident_rows + 1, k, tiles)
            assert all(g.fits(o, 16, k, tiles) for o in CONFIGS if not (o.resident or o.smem))
    # the row statistics' entries divide every tile, the resident one's included
    for rows in range(1, resident_rows + 1):
        assert all(c.block_n % g.stats_granule(rows) == 0 for c in CONFIGS)
    beyond = g.stats_granule(resident_rows + 1)
    assert all(c.block_n % beyond == 0 for c in CONFIGS if not c.resident)
    # rows of statistics laid one after the other fit the buffer at every row count
    for n in (80, 576, 2048, 8192):
        for rows in range(1, g.MAX_ROWS + 1):
            assert rows * g.stats_columns(n, rows) <= g.MAX_ROWS * g.stats_columns(n)


@pytest.mark.parametrize("max_tiles", [1, 2])
def test_a_shared_memory_launch_is_for_3_to_8_rows_whose_tiles_and_weight_fit(max_tiles):
    # cached plans name configs by index: the shared-memory shape comes last
    assert CONFIGS[-1].smem and not any(c.smem for c in CONFIGS[:-1])
    assert rules().smem_max_tiles == 1  # the rule's default: two tiles measured slower
    with rules_in_force(LaunchRules(smem_max_tiles=max_tiles)):
        _smem_launches_fit(max_tiles)


def _smem_launches_fit(max_tiles: int) -> None:
    from ostinato.engine.kernels import gemm_launch as g

    for k in range(16, 12000, 80):
        for tiles in (1, 2, 3):
            for rows in range(1, g.MAX_ROWS + 1):
                whole = k % 64 == 0  # 4 warps' columns in steps of 16
                held = (16 * tiles + (8 if rows <= 8 else 16)) * 4 * triton_p2(k // 4) * 2
                fit = tiles <= 2 and 3 <= rows <= 8 and whole and held <= 227 * 1024
                assert g.fits(CONFIGS[-1], rows, k, tiles) == fit, (k, tiles, rows)
                choice = g.smem_config(k, tiles, rows)
                assert (choice is not None) == (fit and tiles <= max_tiles), (k, tiles, rows)
                if choice is None:
                    continue
                # a weight all SMs' shared memory cannot hold at once streams instead
                assert g.smem_config(k, tiles, rows, 16 << 20) == choice
                assert g.smem_config(k, tiles, rows, (16 << 20) + 1) is None
                c = CONFIGS[choice - 1]
                # one row-statistics entry a row per program
                assert c.smem and c.block_n == g.stats_granule(rows)
                step = g.smem_k_step(k, c.num_warps)
                assert step in (16, 32, 64) and k % (c.num_warps * step) == 0
                assert step == 64 or k % (c.num_warps * 2 * step)


def triton_p2(k: int) -> int:
    p = 1
    while p < k:
        p *= 2
    return p


@pytest.mark.parametrize("max_tiles", [1, 2])
def test_the_qkv_launch_holds_its_weight_at_few_rows_without_head_norms(max_tiles):
    with rules_in_force(LaunchRules(smem_max_tiles=max_tiles)):
        _qkv_launches_hold_their_weight(max_tiles)


def _qkv_launches_hold_their_weight(max_tiles: int) -> None:
    from ostinato.engine.kernels import gemm_launch as g

    for heads, d, k in ((48, 64, 2048), (15, 64, 576), (12, 128, 4096), (40, 128, 5120)):
        weight = heads * d * k * 2
        resident = g.resident_config(k, tiles=2, weight_bytes=weight) is not None
        for rows in range(1, g.MAX_ROWS + 1):
            for norms in (False, True):
                c = g.rope_config(heads, d, k, 132, rows, norms, weight)
                few = rows <= rules().resident_max_rows
                assert c.resident == (few and resident and not norms), (heads, k, rows)
                smem = g.smem_config(k, 2, rows, weight) is not None
                assert c.smem == (not few and smem and not norms), (heads, k, rows)
                if not (c.resident or c.smem):
                    split = rope_split_k(heads, k, 132)
                    assert c == GemmConfig(d // 2, split, block_k=g.k_step(k, split))
    # the 1.5 B shape's QKV (12.6 MB) in shared memory from 3 to 8 rows, where allowed
    held = max_tiles == 2
    assert [g.rope_config(48, 64, 2048, 132, r, False, 48 * 64 * 2048 * 2).smem
            for r in range(1, 17)] == [False] * 2 + [held] * 6 + [False] * 8  # fmt: skip


def test_the_qkv_kernel_launches_on_the_projection_s_plan_where_the_rule_says(monkeypatch):
    # ``LaunchRules.qkv_on_plan``: an unfused layer's ROPE_KV kernel launches on the QKV
    # projection's plan entry for the rows (None: ``rope_config``'s rule) but for head
    # norms on a resident or shared-memory launch, which need a program per head; no
    # entry, no plan launch.
    from ostinato.engine.kernels.gemm_launch import CONFIGS

    x, w = torch.zeros(2, 8), torch.zeros(24, 8)
    plain = fused_ops.HeadsOf(0, 2, 1)
    normed = fused_ops.HeadsOf(0, 2, 1, torch.ones(8), torch.ones(8), 1e-6)
    resident = 1 + next(i for i, c in enumerate(CONFIGS) if c.resident)
    for entry in (1, resident):
        monkeypatch.setattr(fused_ops, "kernel_rows", lambda *args, e=entry: e)
        assert fused_ops._planned(x, w, [], plain) == CONFIGS[entry - 1]
        with rules_in_force(LaunchRules(qkv_on_plan=False)):
            assert fused_ops._planned(x, w, [], plain) is None
    assert fused_ops._planned(x, w, [], normed) is None  # (resident: a program per head)
    monkeypatch.setattr(fused_ops, "kernel_rows", lambda *args: 1)
    assert fused_ops._planned(x, w, [], normed) == CONFIGS[0]
    monkeypatch.setattr(fused_ops, "kernel_rows", lambda *args: 0)
    assert fused_ops._planned(x, w, [], plain) is None
