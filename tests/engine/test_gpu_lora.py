"""GPU tests of LoRA adapters inside graphs: requests of three adapters and of the base
model in one batch against transformers with PEFT on the same weights, in every graph
mode with checked replays; float32 token for token, bf16 over 256 tokens along PEFT's
greedy path (mixed in one batch, and each request alone)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")
from hf_models import peft_greedy, write_adapter, write_checkpoint  # noqa: E402

from ostinato.engine import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
MODES = ["none", "full", "full_decode_only", "full_and_piecewise"]
PROMPTS = [[(11 * i + 5 * j) % 500 + 1 for j in range(30 + 13 * i)] for i in range(6)]
NAMES = ["a", None, "b", "c", "a", None]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu_lora")
    hf = write_checkpoint("LlamaForCausalLM", folder, max_position_embeddings=512)
    adapters = {
        "a": write_adapter(hf, folder / "a", seed=1, rank=16),
        "b": write_adapter(hf, folder / "b", seed=2, rank=8, use_rslora=True),
        "c": write_adapter(hf, folder / "c", seed=3, rank=4, modules=["v_proj", "up_proj"]),
    }
    return folder, hf, adapters


def engine(folder, mode: str, dtype: torch.dtype, **kw) -> LLM:
    modules = tuple(f"{n}={folder / n}" for n in "abc")
    return LLM(
        str(folder), mode=mode, dtype=dtype, max_model_len=512, max_num_seqs=8,
        progress=False, enable_lora=True, max_loras=3, lora_modules=modules,
        verify="capture" if mode != "none" else "off", **kw,
    )  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_mixed_adapters_in_graphs_equal_peft_float32(checkpoint, mode):
    folder, hf, adapters = checkpoint
    llm = engine(folder, mode, torch.float32)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True), lora=NAMES)
    stats = llm.graph_stats()
    llm.close()
    for prompt, name, out in zip(PROMPTS, NAMES, outs, strict=True):
        reference = (hf if name is None else adapters[name]).cuda()
        assert out.token_ids == peft_greedy(reference, prompt, 48), (mode, name)
    if mode != "none":
        assert stats.replays > 0


def _near_greedy(model, prompt: list[int], tokens: list[int]) -> tuple[float, float]:
    """Along ``prompt + tokens``, (the share of ``tokens`` that are ``model``'s argmax, the
    largest gap between its best logit and the token's, in units of the logits' std)."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
    gap = (logits.max(-1).values - chosen) / logits.std(-1)
    best = (logits.argmax(-1) == torch.tensor(tokens, device="cuda")).float().mean()
    return best.item(), gap.max().item()


@pytest.mark.parametrize("mode", MODES)
def test_mixed_adapters_in_bf16_graphs_follow_peft_over_256_tokens(checkpoint, mode):
    # bf16 rounds differently from PEFT's float32 reference, so near-ties flip (the base
    # model's bf16 path agreed on 94% of 256 tokens on an H200): each token must be the
    # reference's argmax or as near it as PEFT's own bf16 path gets (within 2x, or 5% of
    # a logit std), and most must be exactly it; so must each request's tokens when it
    # runs alone (other rows, other kernels' launches).
    # The base model's path, against adapter a, must fail that: LoRA ignored would not.
    folder, hf, adapters = checkpoint
    llm = engine(folder, mode, torch.bfloat16)
    params = SamplingParams(max_tokens=256, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, lora=NAMES)
    alone = [llm.generate([p], params, lora=[n])[0] for p, n in zip(PROMPTS, NAMES, strict=True)]
    llm.close()
    for prompt, name, out, solo in zip(PROMPTS, NAMES, outs, alone, strict=True):
        model = hf if name is None else adapters[name]
        theirs = peft_greedy(copy.deepcopy(model).cuda().to(torch.bfloat16), prompt, 256)
        reference = model.cuda()
        _, their_gap = _near_greedy(reference, prompt, theirs)
        for how, tokens in (("mixed", out.token_ids), ("alone", solo.token_ids)):
            share, gap = _near_greedy(reference, prompt, tokens)
            print(f"{mode} {name} {how}: ours {share:.3f} {gap:.3f}, PEFT bf16 gap {their_gap:.3f}")
            assert share >= 0.85 and gap <= max(0.05, 2 * their_gap), (mode, name, how, share, gap)
    _, gap = _near_greedy(adapters["a"].cuda().float(), PROMPTS[1], outs[1].token_ids)
    assert gap > 0.5, gap  # the base model's path is far from adapter a's


def test_specialised_graphs_skip_the_lora_gemms_for_base_steps(checkpoint):
    folder, _, _ = checkpoint
    llm = engine(folder, "full", torch.bfloat16)
    from ostinato.modes import GraphMode

    keys = llm.engine.runner.graphs.dispatcher.keys(GraphMode.FULL)
    assert {d.has_lora for d in keys} == {True, False}
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), lora=[None, None])
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), lora=["a", None])
    used = {b.descriptor.has_lora for b in llm.graph_stats().buckets if b.replays}
    assert used == {True, False}
    llm.close()


SLOTS = 4  # adapter slots of the expand kernel's tests


def expand_case(seed, rows, dtype, width, n):
    """Random operands of ``lora_expand`` (``s``, ``b``, ``y`` in ``dtype``, ``slots`` with
    -1 for rows without one) and the dense path's sum in float64: every slot's shrink
    masked to the row's own, expanded and added to ``y``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = torch.randn(rows, SLOTS * width, device="cuda", generator=gen).to(dtype)
    b = (torch.randn(SLOTS * width, n, device="cuda", generator=gen) * 0.05).to(dtype)
    y = torch.randn(rows, n, device="cuda", generator=gen).to(dtype)
    slots = torch.randint(-1, SLOTS, (64,), device="cuda", generator=gen)
    mask = (slots[:rows, None] == torch.arange(SLOTS, device="cuda")).double()
    masked = (s.double().unflatten(1, (SLOTS, -1)) * mask.unsqueeze(-1)).flatten(1)
    return s, b, y, slots, y.double() + masked @ b.double()


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_expand_kernel_equals_the_dense_delta(dtype, rows, pdl):
    # The decode graphs' expand (each row gathers its slot of B) against the dense path's
    # arithmetic (every slot, masked) in float64; rows without a slot stay bitwise. With
    # PDL (an H200's launches) it waits for the GEMM before it like any other kernel.
    from ostinato.engine.kernels.lora_expand import lora_expand

    s, b, y, slots, want = expand_case(rows, rows, dtype, width=48, n=2560)
    got = lora_expand(y.clone(), s, b, slots, SLOTS, pdl=pdl).double()
    err = ((got - want).norm() / want.norm()).item()
    assert err < (1e-6 if dtype is torch.float32 else 1e-2), err
    none = slots[:rows] < 0
    assert torch.equal(got[none], y.double()[none])


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_qkv_expand_writes_the_cache_as_the_unfused_ops(dtype, rows, qk_norm):
    # The QKV group's expand with the head norms, RoPE and the K/V write in one kernel
    # (PDL on, as on an H200) against the dense sum, then the torch ops, in float64.
    from ostinato.engine.kernels.lora_expand import lora_expand_qkv
    from ostinato.engine.kernels.small_gemm import RopeKV
    from ostinato.engine.model.norm_op import rms_norm_reference
    from ostinato.engine.model.rope import apply_rope

    heads, kv_heads, d = 12, 2, 128  # the 1.5 B shape's
    s, b, y, slots, dense = expand_case(30 + rows, rows, dtype, width=48, n=2048)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    pos = torch.randint(0, 4000, (rows,), device="cuda", generator=gen).double()
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda").double() / d)
    emb = torch.cat([pos[:, None] * inv] * 2, -1)[:, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    k_cache = torch.randn(8, 16, kv_heads, d, device="cuda", generator=gen).to(dtype)
    v_cache = torch.randn(8, 16, kv_heads, d, device="cuda", generator=gen).to(dtype)
    kv_slots = torch.randperm(128, device="cuda", generator=gen)[:rows]
    norms = [(1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).to(dtype) for _ in "qk"]
    q_norm, k_norm = norms if qk_norm else (None, None)
    want_k, want_v = k_cache.double(), v_cache.double()
    rope = RopeKV(cos, sin, k_cache, v_cache, kv_slots, heads, kv_heads, q_norm, k_norm, 1e-5)
    q = torch.empty(rows, heads * d, device="cuda", dtype=dtype)
    lora_expand_qkv(y, s, b, slots, SLOTS, rope, q, pdl=True)

    total = dense.to(dtype).double().view(rows, -1, d)
    wq, wk, wv = total.split([heads, kv_heads, kv_heads], 1)
    if qk_norm:
        wq, wk = (rms_norm_reference(t, w.double(), 1e-5) for t, w in ((wq, q_norm), (wk, k_norm)))
    want_k.view(-1, kv_heads, d)[kv_slots] = apply_rope(wk, cos.double(), sin.double())
    want_v.view(-1, kv_heads, d)[kv_slots] = wv
    tolerance = 1e-6 if dtype is torch.float32 else 1e-2
    for got, want in ((q, wq.reshape(rows, -1)), (k_cache, want_k), (v_cache, want_v)):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < tolerance, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_expand_kernels_swiglu_equals_silu_mul_of_the_dense_sum(dtype, rows):
    # The gate/up group's expand with SiLU·mul in the same kernel against the unfused
    # path: the dense sum rounded to the dtype, then ostinato::silu_mul.
    import ostinato.engine.model.silu_mul_op  # noqa: F401  (registers ostinato::silu_mul)
    from ostinato.engine.kernels.lora_expand import lora_expand

    s, b, y, slots, dense = expand_case(10 + rows, rows, dtype, width=32, n=2 * 1792)
    want = torch.ops.ostinato.silu_mul(dense.to(dtype), False).double()
    got = lora_expand(y.clone(), s, b, slots, SLOTS, swiglu=True, pdl=True).double()
    err = ((got - want).norm() / want.norm()).item()
    assert err < (1e-6 if dtype is torch.float32 else 1e-2), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("width", [16, 64])  # B's rows loaded before the PDL wait, and not
def test_the_norm_with_each_rows_delta_equals_the_expand_then_the_norm(dtype, rows, width):
    # The O projection's expand inside the norm after it (ostinato::lora_add_rms_norm)
    # against the two kernels it replaces: the expand into a new tensor, then
    # add_rms_norm. The delta sums in another order, so bf16 may round an element to
    # its neighbour; rows without a slot stay bitwise.
    import ostinato.engine.model.norm_op  # noqa: F401  (registers the ops)
    from ostinato.engine.kernels.lora_expand import lora_expand
    from ostinato.engine.kernels.rms_norm import loads_b_ahead

    assert loads_b_ahead(width, 2048, 8) == (width == 16)
    s, b, y, slots, _ = expand_case(20 + rows, rows, dtype, width=width, n=1536)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    residual = torch.randn(rows, 1536, device="cuda", generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(1536, device="cuda", generator=gen)).to(dtype)
    x = torch.cat([y, y[:, :64]], dim=1)[:, :1536]  # a strided view, as the joint GEMM's
    expanded = lora_expand(x, s, b, slots, SLOTS, in_place=False)
    want = torch.ops.ostinato.add_rms_norm(expanded, residual, weight, 1e-5, False)
    got = torch.ops.ostinato.lora_add_rms_norm(x, residual, weight, 1e-5, s, b, slots, SLOTS)
    for g, w in zip(got, want, strict=True):
        err = ((g.double() - w.double()).norm() / w.double().norm()).item()
        assert err < (1e-6 if dtype is torch.float32 else 1e-2), err
        none = slots[:rows] < 0
        assert torch.equal(g[none], w[none])


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("launch", ["resident", "smem", "rule"])
def test_the_joint_gemm_runs_the_projections_plan(rows, launch):
    # A LoRA step's projection and shrinks come from one GEMM over the joint weight; where
    # the projection has a small-row plan that GEMM is the plan's Triton kernel (the base
    # step's measured choice), not cuBLAS, and equals the float32 product to bf16 rounding.
    from ostinato.engine.kernels import gemm_launch as g
    from ostinato.engine.kernels.launch import num_sms
    from ostinato.engine.model.linear import Linear
    from ostinato.engine.model.lora import LoraProjection, LoraShape

    torch.manual_seed(rows)
    k, out = 1536, 2048
    linear = Linear(k, out, bias=False).cuda().bfloat16()
    slots = LoraProjection(k, (out,), LoraShape(max_loras=3, max_rank=16, max_tokens=16))
    slots = slots.cuda().bfloat16()
    slots.a.normal_()
    slots.join(linear)
    weight_bytes = linear.weight.numel() * 2
    entry = {
        "resident": g.resident_config(k, 1, 0, rows),
        "smem": g.smem_config(k, 1, rows),
        "rule": g.pick_config(out, k, num_sms(linear.weight.device)),
    }[launch]
    if entry is None:
        pytest.skip(f"no {launch} launch for {rows} rows over {k} columns ({weight_bytes} B)")
    linear.use_plan((0,) + (entry,) * g.MAX_ROWS, 0, False)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y, s = slots._joint(linear, x)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("_gemm_kernel" in name for name in names), names
    want = x.float() @ slots.joint.float().t()
    got = torch.cat([y, s], dim=1).float()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, err
    assert torch.count_nonzero(slots.counters) == 0  # (left zero for the next replay)


def _segment_reference(x, weight, s, b, slots, width):
    """``x @ weight.T`` plus each row's ``s @ B_slot`` in float64 (the segment's sum)."""
    y = x.double() @ weight.double().t()
    for i, slot in enumerate(slots[: x.shape[0]].tolist()):
        if slot >= 0:
            y[i] += s[i].double() @ b[slot * width : (slot + 1) * width].double()
    return y


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("launch", ["resident", "split", "unsplit"])
def test_the_gemm_adds_each_rows_expand_before_its_epilogue(rows, launch, swiglu):
    # The QKV and gate/up groups' expand inside their GEMM (the LoRA segment: each slot a
    # row uses, its rows of s on tensor cores, or summed on CUDA cores for the resident
    # launch's rows) against the projection plus each row's delta in float64; then
    # SiLU·mul of the two halves rounded as the epilogue rounds them. PDL on.
    from ostinato.engine.kernels import gemm_launch as g
    from ostinato.engine.kernels.lora_segment import LoraSegment
    from ostinato.engine.kernels.small_gemm import small_gemm

    k, n, width = 2048, 2 * 1792 if swiglu else 2560, 48
    config = {
        "resident": g.GemmConfig(g.RESIDENT_N, 1, resident=True),
        "split": g.GemmConfig(32, 4),
        "unsplit": g.GemmConfig(64, 1, block_k=256),
    }[launch]
    if not g.fits(config, rows, k, 2 if swiglu else 1):
        pytest.skip(f"{launch} takes no {rows} rows")
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(n, k, device="cuda", generator=gen) * 0.03).bfloat16()
    s = torch.randn(rows, width, device="cuda", generator=gen).bfloat16()
    b = (torch.randn(SLOTS * width, n, device="cuda", generator=gen) * 0.1).bfloat16()
    slots = torch.randint(-1, SLOTS, (64,), device="cuda", generator=gen)
    counters = torch.zeros(g.counters_needed(n), dtype=torch.int32, device="cuda")
    segment = LoraSegment(s, b, slots, SLOTS)
    got = small_gemm(x, weight, None, counters, config, swiglu, True, lora=segment).double()
    want = _segment_reference(x, weight, s, b, slots, width)
    if swiglu:
        gate, up = want.bfloat16().double().chunk(2, dim=1)
        want = gate * torch.sigmoid(gate) * up
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, err
    assert torch.count_nonzero(counters) == 0  # (left zero for the next replay)
    plain = small_gemm(x, weight, None, counters, config, swiglu, True).double()
    none = slots[:rows] < 0
    assert torch.equal(got[none], plain[none])  # (rows without a slot: the GEMM's bits)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_qkv_gemm_with_each_rows_expand_writes_the_cache_as_the_unfused_ops(rows, qk_norm):
    # One kernel for a LoRA step's QKV group (the GEMM, each row's expand, head norms,
    # RoPE, the K/V write) against the float64 sum, then the torch ops.
    from ostinato.engine.kernels.gemm_launch import counters_needed, rope_config
    from ostinato.engine.kernels.launch import num_sms
    from ostinato.engine.kernels.lora_segment import LoraSegment
    from ostinato.engine.kernels.small_gemm import RopeKV, qkv_rope_kv
    from ostinato.engine.model.norm_op import rms_norm_reference
    from ostinato.engine.model.rope import apply_rope

    heads, kv_heads, d, k, width = 12, 2, 128, 1536, 48  # the 1.5 B shape's
    gen = torch.Generator(device="cuda").manual_seed(rows)
    cols = (heads + 2 * kv_heads) * d
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(cols, k, device="cuda", generator=gen) * 0.03).bfloat16()
    s = torch.randn(rows, width, device="cuda", generator=gen).bfloat16()
    b = (torch.randn(SLOTS * width, cols, device="cuda", generator=gen) * 0.1).bfloat16()
    slots = torch.randint(-1, SLOTS, (64,), device="cuda", generator=gen)
    pos = torch.randint(0, 4000, (rows,), device="cuda", generator=gen).double()
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda").double() / d)
    emb = torch.cat([pos[:, None] * inv] * 2, -1)[:, None, :]
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    k_cache = torch.randn(8, 16, kv_heads, d, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn(8, 16, kv_heads, d, device="cuda", generator=gen).bfloat16()
    kv_slots = torch.randperm(128, device="cuda", generator=gen)[:rows]
    norms = [(1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).bfloat16() for _ in "qk"]
    q_norm, k_norm = norms if qk_norm else (None, None)
    want_k, want_v = k_cache.double(), v_cache.double()
    rope = RopeKV(cos, sin, k_cache, v_cache, kv_slots, heads, kv_heads, q_norm, k_norm, 1e-5)
    config = rope_config(heads + 2 * kv_heads, d, k, num_sms(x.device), rows, True)
    counters = torch.zeros(counters_needed(cols), dtype=torch.int32, device="cuda")
    q = torch.empty(rows, heads * d, device="cuda", dtype=torch.bfloat16)
    segment = LoraSegment(s, b, slots, SLOTS)
    qkv_rope_kv(x, weight, None, counters, config, rope, None, True, out=q, lora=segment)

    total = _segment_reference(x, weight, s, b, slots, width).bfloat16().double()
    wq, wk, wv = total.view(rows, -1, d).split([heads, kv_heads, kv_heads], 1)
    if qk_norm:
        wq, wk = (rms_norm_reference(t, w.double(), 1e-5) for t, w in ((wq, q_norm), (wk, k_norm)))
    want_k.view(-1, kv_heads, d)[kv_slots] = apply_rope(wk, cos.double(), sin.double())
    want_v.view(-1, kv_heads, d)[kv_slots] = wv
    for got, want in ((q, wq.reshape(rows, -1)), (k_cache, want_k), (v_cache, want_v)):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-2, err


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("delta", [False, True])
def test_the_norm_shrinks_each_row_for_the_projection_after_it(rows, delta):
    # The norm before a LoRA step's QKV or gate/up group also shrinks each normed row by
    # its slot's A (several programs a row): the rows and the sum stay the norm's bits,
    # and the shrink equals the stored rows times A in float64. PDL on.
    from ostinato.engine.kernels.rms_norm import Shrink, rms_norm_rows

    dim, width, gen = 2048, 48, torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, dim, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(rows, dim, device="cuda", generator=gen).bfloat16()
    weight = (1 + 0.1 * torch.randn(dim, device="cuda", generator=gen)).bfloat16()
    a = (torch.randn(SLOTS * width, dim, device="cuda", generator=gen) * 0.05).bfloat16()
    slots = torch.randint(-1, SLOTS, (64,), device="cuda", generator=gen)
    expand = None
    if delta:
        s = torch.randn(rows, SLOTS * 16, device="cuda", generator=gen).bfloat16()
        b = (torch.randn(SLOTS * 16, dim, device="cuda", generator=gen) * 0.05).bfloat16()
        expand = (s, b, slots, SLOTS)
    out, total = torch.empty_like(x), torch.empty_like(x)
    shrunk = torch.full((rows, width), 7.0, device="cuda").bfloat16()
    rms_norm_rows(
        x, residual, weight, 1e-5, out, total, True, expand, Shrink(a, shrunk, slots, SLOTS)
    )
    plain_out, plain_total = torch.empty_like(x), torch.empty_like(x)
    rms_norm_rows(x, residual, weight, 1e-5, plain_out, plain_total, True, expand)
    assert torch.equal(out, plain_out) and torch.equal(total, plain_total)
    want = torch.zeros(rows, width, dtype=torch.float64, device="cuda")
    for i, slot in enumerate(slots[:rows].tolist()):
        if slot >= 0:
            want[i] = out[i].double() @ a[slot * width : (slot + 1) * width].double().t()
    err = ((shrunk.double() - want).norm() / want.norm().clamp_min(1e-9)).item()
    assert err < 1e-2, err
    assert torch.all(shrunk[slots[:rows] < 0] == 0)


def test_a_bf16_lora_decode_step_runs_no_expand_kernel(tmp_path):
    # bf16 decode rows shrink in the norms and expand inside the QKV and gate/up GEMMs
    # (heads of 32: the ROPE_KV epilogue's): neither expand kernel runs in a LoRA step's
    # graph, and greedy tokens stay near PEFT's over 64 (the 256-token test's measure).
    hf = write_checkpoint("LlamaForCausalLM", tmp_path, max_position_embeddings=512, head_dim=32)
    adapter = write_adapter(hf, tmp_path / "a", seed=1, rank=16)
    llm = LLM(
        str(tmp_path), mode="full", dtype=torch.bfloat16, max_model_len=512, max_num_seqs=8,
        progress=False, enable_lora=True, max_loras=2, lora_modules=(f"a={tmp_path / 'a'}",),
    )  # fmt: skip
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    names = ["a", None, "a"]
    assert llm.wait_for_graphs(timeout=300)  # (no capture runs beside the profiled steps)
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=4), lora=names)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        outs = llm.generate(PROMPTS[:3], params, lora=names)
        torch.cuda.synchronize()
    llm.close()
    for prompt, name, out in zip(PROMPTS[:3], names, outs, strict=True):
        share, _ = _near_greedy((adapter if name else hf).cuda(), prompt, out.token_ids)
        assert share >= 0.85, (name, share)
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert not {n for n in names if "expand" in n}, names
    assert any("_rms_norm_kernel" in n for n in names) and any("_gemm_kernel" in n for n in names)
