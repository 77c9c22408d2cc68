"""GPU tests of the fused decoder layer (``KernelOptions.fused_layers``): each fused kernel
against the unfused torch arithmetic on random and model shapes, in and out of graphs;
a whole decode step bitwise the same replayed from a graph as run eagerly; at most six
kernels per layer; and the engine's greedy tokens with and without the fusion."""

import pytest
import torch
import torch.nn.functional as F
from gpu_harness import (
    greedy_tokens,
    lockstep,
    pin_fused_layers,
    row_stats_of,
    stats_rows,
    tiny_engine,
)

from ostinato.engine import KernelOptions
from ostinato.engine.model.norm_op import add_rms_norm_reference, rms_norm_reference
from ostinato.engine.model.rope import apply_rope
from ostinato.engine.model.silu_mul_op import silu_mul_reference

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
BF = dict(device=DEVICE, dtype=torch.bfloat16)

# (hidden, heads, kv heads, head dim, intermediate): random, SmolLM2-135M, Llama-3.2-1B, Qwen3
SHAPES = [
    (256, 8, 2, 32, 512),
    (576, 9, 3, 64, 1536),
    (2048, 32, 8, 64, 8192),
    (512, 4, 2, 128, 768),
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _rows(m: int, hidden: int, residual: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = torch.randn(m, hidden, **BF)
    return x, (torch.randn(m, hidden, **BF) if residual else None)


def _reference_norm(x, residual, w, eps):
    if residual is None:
        return rms_norm_reference(x, w, eps), None
    return add_rms_norm_reference(x, residual, w, eps)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "m, held", [(1, False), (1, True), (2, True), (3, True), (5, False), (8, True), (16, False)]
)
def test_norm_gate_up_swiglu_kernel_matches_the_unfused_ops(shape, m, held):
    # held: the weight in registers (resident, up to 2 rows) or shared memory (3 to 8)
    from ostinato.engine.kernels import small_gemm as tg
    from ostinato.engine.kernels.gemm_launch import pick_config, resident_config
    from ostinato.engine.kernels.launch import num_sms

    torch.manual_seed(m)
    hidden, *_, inter = shape
    x, residual = _rows(m, hidden, True)
    norm_w = 1 + 0.1 * torch.randn(hidden, **BF)
    w = torch.randn(2 * inter, hidden, **BF) / hidden**0.5
    counters = torch.zeros(tg.counters_needed(2 * inter), dtype=torch.int32, device=DEVICE)
    total = torch.empty_like(x)
    choice = pick_config(inter, hidden, num_sms(DEVICE), swiglu=True)
    if held:  # from 3 rows the shared-memory shape, which the rule does not take today
        choice = resident_config(hidden, tiles=2) if m <= 2 else len(tg.CONFIGS)
    config = tg.CONFIGS[choice - 1]
    assert config.resident == (held and m <= 2) and config.smem == (held and m > 2)
    assert tg.fits(config, m, hidden, 2)
    prologue = tg.NormPrologue(norm_w, 1e-5, residual, total)
    got = tg.small_gemm(x, w, None, counters, config, True, True, prologue)
    h, want_total = _reference_norm(x, residual, norm_w, 1e-5)
    want = silu_mul_reference(F.linear(h, w))
    assert torch.equal(total, want_total)  # the residual sum, rounded as torch's add
    assert rel_err(got, want) < 1e-2
    assert counters.count_nonzero() == 0  # left zero for the next call or replay


# (hidden, vocabulary): random with a last partial tile, SmolLM2-135M, Llama-3.2-1B
HEADS = [(256, 1000), (576, 49152), (2048, 128256)]


@pytest.mark.parametrize("hidden, vocab", HEADS)
@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("stats", [False, True])
def test_final_norm_lm_head_kernel_matches_the_unfused_ops(hidden, vocab, m, stats):
    # DecoderModel.logits' one kernel: the final norm of x + residual in the LM head's
    # prologue, in the launch the default plan names, its sums of squares from the
    # last layer's row statistics (``stats``) or its own pass over the rows.
    from ostinato.engine.kernels import small_gemm as tg
    from ostinato.engine.worker.gemm_tuning import _default_plan

    torch.manual_seed(m)
    x, residual = _rows(m, hidden, True)
    norm_w = 1 + 0.1 * torch.randn(hidden, **BF)
    w = torch.randn(vocab, hidden, **BF) / hidden**0.5
    counters = torch.zeros(tg.counters_needed(vocab), dtype=torch.int32, device=DEVICE)
    total = torch.empty_like(x)
    sums = None
    if stats:
        sums = torch.zeros(tg.MAX_ROWS, tg.stats_columns(hidden), device=DEVICE)
        stats_rows(sums, m, hidden).copy_(row_stats_of(x + residual))
    config = tg.CONFIGS[_default_plan(w, False)[m] - 1]
    prologue = tg.NormPrologue(norm_w, 1e-5, residual, total, sums)
    got = tg.small_gemm(x, w, None, counters, config, False, True, prologue)
    h, want_total = _reference_norm(x, residual, norm_w, 1e-5)
    assert torch.equal(total, want_total)
    assert rel_err(got, F.linear(h, w)) < 1e-2
    assert counters.count_nonzero() == 0


def _qkv_case(shape, m, qk_norm, bias, seed=0):
    torch.manual_seed(seed)
    hidden, heads, kv_heads, d, _ = shape
    block = 16
    per_seq = 16  # pages per row: position 15 * 13 + 7 is in page 12
    cache = torch.randn(m * per_seq + 1, block, kv_heads, d, **BF)
    pos = torch.arange(m, device=DEVICE) * 13 + 7
    slots = (1 + torch.arange(m, device=DEVICE) * per_seq + pos // block) * block + pos % block
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d)
    freqs = pos.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)[:, None, :]
    n = (heads + 2 * kv_heads) * d
    return dict(
        x=torch.randn(m, hidden, **BF),
        residual=torch.randn(m, hidden, **BF),
        norm_w=1 + 0.1 * torch.randn(hidden, **BF),
        w=torch.randn(n, hidden, **BF) / hidden**0.5,
        b=0.1 * torch.randn(n, **BF) if bias else None,
        q_norm=1 + 0.1 * torch.randn(d, **BF) if qk_norm else None,
        k_norm=1 + 0.1 * torch.randn(d, **BF) if qk_norm else None,
        cos=emb.cos().bfloat16(),
        sin=emb.sin().bfloat16(),
        k_cache=cache,
        v_cache=cache.clone(),
        slots=slots,
        heads=heads,
        kv_heads=kv_heads,
        d=d,
    )


def _qkv_reference(c, eps=1e-5, norm=True):
    m = c["x"].shape[0]
    h, total = _reference_norm(c["x"], c["residual"], c["norm_w"], eps) if norm else (c["x"], None)
    q, k, v = (
        F.linear(h, c["w"], c["b"])
        .view(m, -1, c["d"])
        .split([c["heads"], c["kv_heads"], c["kv_heads"]], dim=1)
    )
    if c["q_norm"] is not None:
        q, k = rms_norm_reference(q, c["q_norm"], eps), rms_norm_reference(k, c["k_norm"], eps)
    return q, apply_rope(k, c["cos"], c["sin"]), v, total


def _run_qkv(c, counters, split, pdl, eps=1e-5, config=None, norm=True):
    from ostinato.engine.kernels import small_gemm as tg
    from ostinato.engine.kernels.gemm_launch import k_step

    total = torch.empty_like(c["x"])
    rope = tg.RopeKV(
        c["cos"], c["sin"], c["k_cache"], c["v_cache"], c["slots"], c["heads"], c["kv_heads"],
        c["q_norm"], c["k_norm"], eps,
    )  # fmt: skip
    prologue = tg.NormPrologue(c["norm_w"], eps, c["residual"], total) if norm else None
    # The K step norm_qkv takes for this split (256 for the 1.5 B shape's long splits).
    if config is None:
        config = tg.GemmConfig(c["d"] // 2, split, block_k=k_step(c["x"].shape[1], split))
    q = tg.qkv_rope_kv(c["x"], c["w"], c["b"], counters, config, rope, prologue, pdl)
    return q, total


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "m, held", [(1, False), (1, True), (2, True), (3, True), (6, False), (8, True), (16, False)]
)
@pytest.mark.parametrize("qk_norm, bias", [(False, False), (False, True), (True, False)])
def test_norm_qkv_rope_kv_kernel_matches_the_unfused_ops(shape, m, held, qk_norm, bias):
    from ostinato.engine.kernels import small_gemm as tg
    from ostinato.engine.kernels.gemm_launch import rope_config, rope_split_k
    from ostinato.engine.kernels.launch import num_sms

    c = _qkv_case(shape, m, qk_norm, bias, seed=m)
    before_k, before_v = c["k_cache"].clone(), c["v_cache"].clone()
    heads = c["heads"] + 2 * c["kv_heads"]
    counters = torch.zeros(tg.counters_needed(heads * c["d"]), dtype=torch.int32, device=DEVICE)
    split = rope_split_k(heads, shape[0], num_sms(DEVICE))
    config = None
    if held:  # resident as norm_qkv takes it at 1 or 2 rows, else the shared-memory shape
        config = rope_config(heads, c["d"], shape[0], num_sms(DEVICE), m)
        if m > 2:
            config = tg.CONFIGS[-1]
        if qk_norm:
            with pytest.raises(ValueError, match="head norms"):
                _run_qkv(c, counters, split, pdl=True, config=config)
            return
        assert config.resident == (m <= 2) and config.smem == (m > 2)
    q, total = _run_qkv(c, counters, split, pdl=True, config=config)
    want_q, want_k, want_v, want_total = _qkv_reference(c)
    assert torch.equal(total, want_total)
    assert rel_err(q.view_as(want_q), want_q) < 1e-2
    kv = c["kv_heads"]
    flat = (t.view(-1, kv, c["d"]) for t in (c["k_cache"], c["v_cache"], before_k, before_v))
    k_flat, v_flat, k_before, v_before = flat
    assert rel_err(k_flat[c["slots"]], want_k) < 1e-2
    assert rel_err(v_flat[c["slots"]], want_v) < 1e-2
    others = torch.ones(k_flat.shape[0], dtype=torch.bool, device=DEVICE)
    others[c["slots"]] = False
    assert torch.equal(k_flat[others], k_before[others])  # nothing else written
    assert torch.equal(v_flat[others], v_before[others])
    assert counters.count_nonzero() == 0


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("norm", [True, False])
def test_the_qkv_kernel_on_a_projection_s_plan_launches_matches_the_unfused_ops(m, norm):
    # ``LaunchRules.qkv_on_plan``: the ROPE_KV kernel launched on the QKV projection's plan
    # entry (a K loop's column tile the half head; resident at one row, shared memory at
    # eight), without a norm (an unfused layer's rows, already normed) and with one (the
    # kernel takes it; ``norm_qkv`` keeps ``rope_config``'s launch, measured faster): q,
    # the cache's keys and values as the unfused ops make them.
    from ostinato.engine.kernels import small_gemm as tg

    picks = [tg.GemmConfig(32, 1), tg.GemmConfig(32, 4), tg.GemmConfig(64, 2, block_k=256)]
    picks.append(next(c for c in tg.CONFIGS if (c.resident if m == 1 else c.smem)))
    for config in picks:
        assert config in tg.CONFIGS
        c = _qkv_case(SHAPES[2], m, False, True, seed=m)
        heads = c["heads"] + 2 * c["kv_heads"]
        counters = torch.zeros(tg.counters_needed(heads * c["d"]), dtype=torch.int32, device=DEVICE)
        if not norm:  # (rows as a norm leaves them)
            c["x"] = _reference_norm(c["x"], c["residual"], c["norm_w"], 1e-5)[0]
        q, _ = _run_qkv(c, counters, 0, pdl=True, config=config, norm=norm)
        want_q, want_k, want_v, _ = _qkv_reference(c, norm=norm)
        kv = c["kv_heads"]
        k_flat, v_flat = (t.view(-1, kv, c["d"]) for t in (c["k_cache"], c["v_cache"]))
        assert rel_err(q.view_as(want_q), want_q) < 1e-2, config
        assert rel_err(k_flat[c["slots"]], want_k) < 1e-2, config
        assert rel_err(v_flat[c["slots"]], want_v) < 1e-2, config
        assert counters.count_nonzero() == 0, config


@pytest.mark.parametrize("split", [1, 4, 0])
def test_fused_kernels_in_a_graph_replay_the_eager_bits_on_new_inputs(split):
    # split 0: the shared-memory launch
    from ostinato.engine.kernels import small_gemm as tg

    shape = SHAPES[1]
    c = _qkv_case(shape, 8, False, True)
    heads = c["heads"] + 2 * c["kv_heads"]
    counters = torch.zeros(tg.counters_needed(heads * c["d"]), dtype=torch.int32, device=DEVICE)
    config = tg.CONFIGS[-1] if split == 0 else None
    assert split or config.smem
    _run_qkv(c, counters, split, pdl=True, config=config)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_graph, total_graph = _run_qkv(c, counters, split, pdl=True, config=config)
    for seed in range(3):
        torch.manual_seed(100 + seed)
        for name in ("x", "residual"):
            c[name].copy_(torch.randn_like(c[name]))
        graph.replay()
        torch.cuda.synchronize()
        k_graph = c["k_cache"].clone()
        q_eager, total_eager = _run_qkv(c, counters, split, pdl=False, config=config)
        assert torch.equal(q_graph, q_eager) and torch.equal(total_graph, total_eager)
        assert torch.equal(c["k_cache"], k_graph)


# The fused layers' Triton GEMM by rule. Measured small-GEMM plans (the default) apply in
# graph modes only, so an eager runner would launch other kernels than the graphs, and a
# projection measured faster on cuBLAS would leave a layer more kernels than the rule's.
RULE_PLANS = KernelOptions(small_gemm=False)


def _smollm2_setup(batch_sizes=(1, 8)):
    # SmolLM2-135M's shape with random weights (benchmarks/configs), 30 layers.
    from dataclasses import replace

    from benchmarks.decode import SMOLLM2_CONFIG, BenchConfig, DecodeSetup, model_config

    cfg = BenchConfig(model=model_config(SMOLLM2_CONFIG))
    return DecodeSetup(replace(cfg, batch_sizes=batch_sizes, kv_len=300), DEVICE)


@pytest.mark.parametrize("batch", [1, 8])
def test_a_decode_step_replayed_is_bitwise_the_eager_step_of_the_same_kernels(batch, monkeypatch):
    from ostinato.modes import GraphMode

    # The eager step runs the fused layers; the FULL runner's layer plan is a timing, and
    # B = 8 measured the unfused layers faster on an H200 (other kernels, other rounding).
    pin_fused_layers(monkeypatch)
    setup = _smollm2_setup()
    step = setup.decode_batch(list(range(3, 3 + batch)))
    logits = []
    for mode in (GraphMode.NONE, GraphMode.FULL):
        runner = setup.runner(mode, None, kernels=RULE_PLANS)
        assert all(layer.fused for layer in runner.model.layers)
        with torch.inference_mode():
            runner.capture()
            logits.append(runner.execute(step).logits.clone())
        runner.release()
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("batch", [1, 8, 16])
def test_a_fused_decode_layer_is_at_most_six_kernels(batch, monkeypatch):
    from benchmarks.census import kernel_census
    from ostinato.modes import GraphMode

    # At a size where the unfused layers measure faster (as B = 8 did on a shared H200)
    # the step runs them; this census is of the fused layer.
    pin_fused_layers(monkeypatch)
    setup = _smollm2_setup(batch_sizes=(batch,))
    runner = setup.runner(GraphMode.FULL, None, kernels=RULE_PLANS)
    with torch.inference_mode():
        runner.capture()
        census = kernel_census(setup.decode_step(runner, batch))
    runner.release()
    layers = setup.config.num_layers
    names = [k.name for k in census.by_name]
    assert census.in_layer(layers) <= 6, names
    # No projection of a layer is cuBLAS's (the LM head, once a step, may be).
    per_layer = [k.name.lower() for k in census.by_name if k.per_step >= layers]
    gemms = [n for n in per_layer if "nvjet" in n or "cublas" in n or "gemm" in n]
    # ours: the K loop, and at 3 to 8 rows the shared-memory launch of O and down
    ours = ["_gemm_kernel", "_smem_gemm_kernel"] if 3 <= batch <= 8 else ["_gemm_kernel"]
    assert sorted(gemms) == ours, names
    # The embedding and RoPE rows come from one kernel (``ostinato::embed_rope``).
    assert "_embed_rope_kernel" in names and not [n for n in names if "indexSelect" in n]


@pytest.mark.parametrize("batch", [1, 8])
def test_a_planned_lm_head_takes_the_final_norm_into_its_kernel(batch):
    # ``DecoderModel.logits`` in the decode graph (FULL_DECODE_ONLY: the LM head inside
    # it): with the LM head planned, no norm kernel of its own; replayed, the eager
    # step's bits; against the norm kernel and cuBLAS, a bf16 tolerance.
    from benchmarks.census import kernel_census
    from ostinato.engine.kernels.launch_rules import LaunchRules, rules_in_force
    from ostinato.modes import GraphMode

    setup = _smollm2_setup(batch_sizes=(batch,))
    step = setup.decode_batch(list(range(3, 3 + batch)))
    logits, names = [], []
    runs = ((GraphMode.NONE, True), (GraphMode.FULL_DECODE_ONLY, True))
    for mode, planned in (*runs, (GraphMode.FULL_DECODE_ONLY, False)):
        with rules_in_force(LaunchRules(plan_lm_head=planned)):
            runner = setup.runner(mode, None, kernels=RULE_PLANS)
            with torch.inference_mode():
                runner.capture()
                assert any(runner.model.lm_head.plan) == planned
                logits.append(runner.execute(step).logits.clone())
                if mode is GraphMode.FULL_DECODE_ONLY:
                    census = kernel_census(setup.decode_step(runner, batch))
                    names.append([k.name for k in census.by_name])
        runner.model.lm_head.use_plan((), 0, False)  # the weights' model is shared
        runner.release()
    assert torch.equal(logits[0], logits[1])
    assert rel_err(logits[1], logits[2]) < 1e-2
    assert not [n for n in names[0] if "norm" in n.lower()], names[0]
    assert [n for n in names[1] if "norm" in n.lower()], names[1]
    # cuBLAS's LM head and the argmax write where replays are read: no copy on the
    # device ends that graph. The planned LM head's op returns a tensor of its own,
    # which the graph copies.
    copies = [[n for n in run if "memcpy" in n.lower() and "HtoD" not in n] for run in names]
    assert copies[0] and not copies[1], names


@pytest.mark.parametrize("batch", [1, 8])
def test_an_unfused_layer_s_qkv_kernel_writes_the_keys_and_values(batch):
    # The unfused layers (every decode size under tensor parallelism) with
    # ``LaunchRules.rope_kv_unfused``, in FULL graphs (whose capture measures the plans
    # that give the QKV projection its Triton launch): the projection's kernel writes the
    # rotated keys and the values (no K/V-write kernel in the step), and the logits agree
    # with the rule off (the GEMM, then the write kernel) to a bf16 tolerance.
    from benchmarks.census import kernel_census
    from ostinato.engine.kernels.launch_rules import LaunchRules, rules_in_force
    from ostinato.engine.model.linear import plan_entry
    from ostinato.modes import GraphMode

    setup = _smollm2_setup(batch_sizes=(batch,))
    step = setup.decode_batch(list(range(3, 3 + batch)))
    unfused = KernelOptions(fused_layers=False)
    logits, names = [], []
    for rule in (True, False):
        with rules_in_force(LaunchRules(rope_kv_unfused=rule)):
            runner = setup.runner(GraphMode.FULL, None, kernels=unfused)
            with torch.inference_mode():
                runner.capture()
                assert not any(layer.fused for layer in runner.model.layers)
                qkv = runner.model.layers[0].self_attn.qkv_proj
                assert plan_entry(qkv.plan, batch), "cuBLAS measured faster: no kernel to test"
                logits.append(runner.execute(step).logits.clone())
                census = kernel_census(setup.decode_step(runner, batch))
                names.append([k.name for k in census.by_name])
        runner.release()
    assert rel_err(logits[0], logits[1]) < 1e-2
    writes = [[n for n in run if "write_kv" in n] for run in names]
    assert not writes[0] and writes[1], names


def test_engine_greedy_tokens_with_and_without_fused_layers_agree():
    # bf16: the fused kernels sum in another order, so logits agree to a tolerance and
    # the engines run in lock step on the eager engine's tokens.
    fused = tiny_engine("full_and_piecewise", torch.bfloat16)
    unfused = tiny_engine(
        "full_and_piecewise", torch.bfloat16, kernels=KernelOptions(fused_layers=False)
    )
    assert (
        fused.engine.runner.kernels.fused_layers and not unfused.engine.runner.kernels.fused_layers
    )
    lockstep(unfused, fused, tolerance=3e-2)
    unfused32 = KernelOptions(fused_layers=False)
    fp32 = [tiny_engine("full_and_piecewise", torch.float32, kernels=k) for k in (None, unfused32)]
    assert greedy_tokens(fp32[0]) == greedy_tokens(fp32[1])  # float32 runs the unfused ops
