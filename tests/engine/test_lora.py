"""LoRA adapters in the engine, against transformers with PEFT on the same weights
(float32, CPU), mixed in one batch with other adapters and the base model; the slots'
bookkeeping under random mixes; every bad input named."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import shutil

import pytest

pytest.importorskip("peft")
from hf_models import cpu_engine, peft_greedy, write_adapter, write_checkpoint  # noqa: E402
from interpreted import TESTS, interpreted, needs_triton  # noqa: E402

from ostinato.engine import SamplingParams  # noqa: E402
from ostinato.engine.api.lora_registry import AdapterInUse  # noqa: E402
from ostinato.engine.core.lora_slots import LoraAdapter, LoraSlots  # noqa: E402
from ostinato.engine.loading.peft_adapter import LoraAdapterError  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_base")
    hf = write_checkpoint("LlamaForCausalLM", folder)
    adapters = {
        "a": write_adapter(hf, folder / "adapter_a", seed=1, rank=8),
        "b": write_adapter(hf, folder / "adapter_b", seed=2, rank=4, use_rslora=True),
        "c": write_adapter(
            hf, folder / "adapter_c", seed=3, rank=8, modules=["q_proj", "down_proj"]
        ),
    }
    return folder, hf, adapters


PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(20 + 9 * i)] for i in range(6)]
NAMES = ["a", None, "b", "c", "a", None]


@pytest.mark.parametrize("specialize", [True, False])
def test_greedy_tokens_of_mixed_adapters_equal_peft_each_alone(checkpoint, specialize):
    folder, hf, adapters = checkpoint
    llm = cpu_engine(folder, enable_lora=True, max_loras=3, max_lora_rank=8, max_num_seqs=6,
                     specialize_lora=specialize)  # fmt: skip
    for name in adapters:
        llm.load_lora(name, str(folder / f"adapter_{name}"))
    assert llm.lora_names == ["a", "b", "c"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, lora=NAMES)
    for prompt, name, out in zip(PROMPTS, NAMES, outs, strict=True):
        reference = hf if name is None else adapters[name]
        assert out.token_ids == peft_greedy(reference, prompt, 24), name
    # Each adapter changes the tokens (the test would pass with LoRA ignored otherwise).
    base = llm.generate(PROMPTS[:1], params)[0].token_ids
    assert outs[0].token_ids != base
    llm.close()


def test_more_adapters_than_slots_wait_for_a_slot_and_stay_correct(checkpoint):
    folder, hf, adapters = checkpoint
    llm = cpu_engine(folder, enable_lora=True, max_loras=1, max_lora_rank=8, max_num_seqs=4)
    for name in adapters:
        llm.load_lora(name, str(folder / f"adapter_{name}"))
    names = ["a", "b", "c", "b"]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = llm.generate(PROMPTS[:4], params, lora=names)
    for prompt, name, out in zip(PROMPTS[:4], names, outs, strict=True):
        assert out.token_ids == peft_greedy(adapters[name], prompt, 10), name
    slots = llm.engine.scheduler.lora_slots
    assert slots.users == [0]
    llm.close()


def test_unload_and_reload_under_the_same_name(checkpoint):
    folder, hf, adapters = checkpoint
    llm = cpu_engine(folder, enable_lora=True, max_loras=2, max_lora_rank=8)
    llm.load_lora("x", str(folder / "adapter_a"))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = llm.generate(PROMPTS[:1], params, lora="x")[0].token_ids
    llm.unload_lora("x")
    assert llm.lora_names == []
    with pytest.raises(ValueError, match="no adapter named 'x'"):
        llm.generate(PROMPTS[:1], params, lora="x")
    llm.load_lora("x", str(folder / "adapter_b"))
    again = llm.generate(PROMPTS[:1], params, lora="x")[0].token_ids
    assert first == peft_greedy(adapters["a"], PROMPTS[0], 8)
    assert again == peft_greedy(adapters["b"], PROMPTS[0], 8)
    llm.close()


def test_lora_modules_load_at_start_up(checkpoint):
    folder, hf, adapters = checkpoint
    llm = cpu_engine(
        folder, enable_lora=True, max_lora_rank=8, lora_modules=(f"b={folder / 'adapter_b'}",)
    )
    assert llm.lora_names == ["b"]
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6, ignore_eos=True), lora="b")
    assert out[0].token_ids == peft_greedy(adapters["b"], PROMPTS[0], 6)
    llm.close()


def test_bad_adapters_and_requests_are_named(checkpoint, tmp_path):
    folder, hf, adapters = checkpoint
    llm = cpu_engine(folder, enable_lora=True, max_loras=2, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8 exceeds max_lora_rank=4"):
        llm.load_lora("a", str(folder / "adapter_a"))
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        llm.load_lora("none", str(tmp_path))
    with pytest.raises(ValueError, match="one name per prompt"):
        llm.generate(PROMPTS[:2], lora=["b"])
    llm.load_lora("b", str(folder / "adapter_b"))
    with pytest.raises(ValueError, match="is loaded; unload it first"):
        llm.load_lora("b", str(folder / "adapter_b"))
    # Target modules the engine does not adapt, and shapes of another model.
    embed = tmp_path / "embed"
    write_adapter(hf, embed, seed=4, rank=2, modules=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match=r"target modules \['embed_tokens'\] are not supported"):
        llm.load_lora("embed", str(embed))
    other_folder = tmp_path / "other"
    other = write_checkpoint("LlamaForCausalLM", other_folder, hidden_size=64, head_dim=8)
    write_adapter(other, tmp_path / "other_adapter", seed=5, rank=2)
    with pytest.raises(ValueError, match="trained for another model"):
        llm.load_lora("other", str(tmp_path / "other_adapter"))
    dora = tmp_path / "dora"
    write_adapter(hf, dora, seed=6, rank=2)
    settings = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA is not supported"):
        llm.load_lora("dora", str(dora))
    (dora / "adapter_config.json").write_text(
        json.dumps({k: v for k, v in settings.items() if k != "r"})
    )
    with pytest.raises(ValueError, match="r must be a positive integer, got None"):
        llm.load_lora("no_rank", str(dora))
    (dora / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json is not JSON"):
        llm.load_lora("broken", str(dora))
    truncated = tmp_path / "truncated"
    shutil.copytree(folder / "adapter_b", truncated)
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(LoraAdapterError, match="adapter_model.safetensors is not safetensors"):
        llm.load_lora("truncated", str(truncated))
    assert llm.lora_names == ["b"]  # (nothing half-loaded)
    with pytest.raises(ValueError, match="no adapter named 'zzz'"):
        llm.unload_lora("zzz")
    assert llm.lora_names == ["b"]
    llm.close()
    base = cpu_engine(folder)
    with pytest.raises(ValueError, match="built without LoRA"):
        base.generate(PROMPTS[:1], lora="b")
    with pytest.raises(ValueError, match="built without LoRA"):
        base.load_lora("b", str(folder / "adapter_b"))
    base.close()


def test_lora_options_are_checked_before_anything_loads(checkpoint):
    folder, _, _ = checkpoint
    with pytest.raises(ValueError, match="lora_modules: given without enable_lora"):
        cpu_engine(folder, lora_modules=("a=/x",))
    for option in (dict(max_loras=2), dict(max_lora_rank=8), dict(specialize_lora=False)):
        with pytest.raises(ValueError, match=f"{next(iter(option))}: given without enable_lora"):
            cpu_engine(folder, **option)
    with pytest.raises(ValueError, match="is not name=path"):
        cpu_engine(folder, enable_lora=True, lora_modules=("nopath",))
    with pytest.raises(ValueError, match="max_loras: expected an integer >= 1"):
        cpu_engine(folder, enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="not with speculative decoding"):
        cpu_engine(folder, enable_lora=True, speculative="ngram")


def test_unloading_an_adapter_in_use_is_refused(checkpoint):
    folder, _, _ = checkpoint
    llm = cpu_engine(folder, enable_lora=True, max_lora_rank=8)
    llm.load_lora("a", str(folder / "adapter_a"))
    refused = []

    def on_token(i: int, token: int) -> None:
        if not refused:
            with pytest.raises(ValueError, match="in use by running requests"):
                llm.unload_lora("a")
            refused.append(True)

    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), lora="a", on_token=on_token)
    assert refused
    llm.unload_lora("a")  # finished: free
    llm.close()


def _adapter(name: str) -> LoraAdapter:
    return LoraAdapter(name, 1, None)


def test_slots_under_random_mixes_are_free_or_owned_by_a_running_request():
    # 1,000 steps of random admissions and finishes against a model of the slots: a slot
    # is used exactly by the requests holding it, its adapter changes only while unused,
    # a load is taken for every change, and a request waits only when every slot is used.
    rng = random.Random(0)
    adapters = [_adapter(f"n{i}") for i in range(7)]
    slots = LoraSlots(3)
    running: list[tuple[LoraAdapter, int]] = []
    device: list[LoraAdapter | None] = [None] * 3  # what the loads wrote
    for _ in range(1000):
        for _ in range(rng.randint(0, 3)):
            adapter = rng.choice(adapters)
            slot = slots.acquire(adapter)
            if slot is None:
                assert all(u > 0 for u in slots.users)
                continue
            running.append((adapter, slot))
        for load in slots.take_loads():
            device[load.slot] = load.adapter
        if rng.random() < 0.1 and adapters:
            victim = rng.choice(adapters)
            if any(a is victim for a, _ in running):
                with pytest.raises(RuntimeError):
                    slots.forget(victim)
            else:
                slots.forget(victim)
        for adapter, slot in running:
            assert device[slot] is adapter and slots.held[slot] is adapter
        for s in range(3):
            assert slots.users[s] == sum(1 for _, slot in running if slot == s)
        rng.shuffle(running)
        for _ in range(rng.randint(0, len(running))):
            _, slot = running.pop()
            slots.release(slot)
    while running:
        slots.release(running.pop()[1])
    assert slots.users == [0, 0, 0]
    with pytest.raises(RuntimeError, match="released more often"):
        slots.release(0)


def test_adapters_load_and_unload_while_the_engine_loop_serves(checkpoint):
    from ostinato.engine.serve.loop import EngineLoop

    folder, hf, adapters = checkpoint
    llm = cpu_engine(folder, enable_lora=True, max_loras=2, max_lora_rank=8)
    loop = EngineLoop(llm)
    try:
        long = loop.submit(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True))
        stream = iter(long)
        base = [next(stream)]  # the loop is stepping now
        asyncio.run(loop.aload_lora("a", str(folder / "adapter_a")))  # (the server's call)
        assert loop.lora_names == ["a"]
        # A request as long as the context allows holds the adapter while it runs (69
        # steps after its first token: far longer than the unload takes to be asked).
        held = loop.submit(PROMPTS[0], SamplingParams(max_tokens=70, ignore_eos=True), "a")
        holding = iter(held)
        next(holding)  # running now, on the adapter
        with pytest.raises(AdapterInUse, match="in use by running requests"):
            asyncio.run(loop.aunload_lora("a"))
        assert loop.abort(held.id)
        list(holding)  # (ended at the next step boundary)
        tuned = loop.submit(PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True), "a")
        assert list(tuned) == peft_greedy(adapters["a"], PROMPTS[2], 12)
        asyncio.run(loop.aunload_lora("a"))  # its requests ended: the slot is free
        assert loop.lora_names == []
        with pytest.raises(ValueError, match="no adapter named 'a'"):
            loop.submit(PROMPTS[2], SamplingParams(max_tokens=2), "a")
        base += list(stream)
        assert base == peft_greedy(hf, PROMPTS[0], 40)
    finally:
        assert loop.stop()
        llm.close()


_INTERPRETED = """
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[1])
from hf_models import cpu_engine, peft_greedy, write_adapter, write_checkpoint

import ostinato.engine.model.lora as lora
import ostinato.engine.model.norm_op as norm_op
from ostinato.engine import SamplingParams
from ostinato.engine.kernels.rms_norm import rms_norm_rows

# The norm's kernel with each row's delta against the delta added first, then the kernel:
# B's rows loaded before the PDL wait (W = 16 here), and one at a time (W = 64).
from ostinato.engine.kernels.rms_norm import loads_b_ahead
assert loads_b_ahead(16, 128, 1) and not loads_b_ahead(64, 128, 1)
g = torch.Generator().manual_seed(0)
for W in (16, 64):
    S, D, n = 3, 96, 5
    s, b = torch.randn(n, S * W, generator=g), torch.randn(S * W, D, generator=g) * 0.05
    x = torch.randn(n, D + 8, generator=g)[:, :D]
    res, w = torch.randn(n, D, generator=g), torch.randn(D, generator=g)
    slots = torch.tensor([2, -1, 0, 1, -1, 2, 2, 2])
    out, total = torch.empty(n, D), torch.empty(n, D)
    rms_norm_rows(x, res, w, 1e-5, out, total, False, (s, b, slots, S))
    want_out, want_total = torch.empty(n, D), torch.empty(n, D)
    rms_norm_rows(norm_op.lora_rows(x, s, b, slots, S), res, w, 1e-5, want_out, want_total)
    torch.testing.assert_close(total, want_total, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[slots[:n] < 0], want_out[slots[:n] < 0])
    # The op's CUDA implementation (add_rms_norm's, with the delta) launches the same.
    op_out, op_total = norm_op._lora_add_rms_norm_cuda(x, res, w, 1e-5, s, b, slots, S)
    assert torch.equal(op_out, out) and torch.equal(op_total, total)

# The engine on the kernels' path (as on CUDA, rows of decode steps): PEFT's tokens.
lora.expands_in_kernel = lambda x: x.shape[0] <= 16 and not torch.compiler.is_compiling()
folder = Path(tempfile.mkdtemp())
hf = write_checkpoint("LlamaForCausalLM", folder)
adapters = {"a": write_adapter(hf, folder / "a", seed=1, rank=8),
            "b": write_adapter(hf, folder / "b", seed=2, rank=4, use_rslora=True)}
llm = cpu_engine(folder, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4)
for name in adapters:
    llm.load_lora(name, str(folder / name))
prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(12 + 5 * i)] for i in range(3)]
names = ["a", None, "b"]
outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), lora=names)
for prompt, name, o in zip(prompts, names, outs):
    reference = hf if name is None else adapters[name]
    assert o.token_ids == peft_greedy(reference, prompt, 8), name
print("ok")
"""


@needs_triton
def test_the_decode_path_of_lora_equals_peft_under_the_triton_interpreter():
    # What CUDA decode steps run (each row's expand gathered in a kernel, the O
    # projection's inside the norm's kernel), on the CPU through Triton's interpreter.
    _interpret(_INTERPRETED, timeout=600)


def _interpret(script: str, timeout: int) -> None:
    """Runs ``script`` under Triton's interpreter (``interpreted``), the tests' folder as
    its first argument; it must print "ok" last."""
    assert interpreted(script, str(TESTS), timeout=timeout).strip().endswith("ok")


_INTERPRETED_QKV = """
import torch
from ostinato.engine.kernels.lora_expand import lora_expand_qkv
from ostinato.engine.kernels.small_gemm import RopeKV
from ostinato.engine.model.norm_op import lora_rows, rms_norm_reference
from ostinato.engine.model.rope import apply_rope

# The QKV group's expand with the K/V write against the torch arithmetic: the sum
# (lora_rows), the head norms, keys rotated and both written at their slots.
g = torch.Generator().manual_seed(0)
S, W, n, heads, kv_heads, d = 3, 8, 4, 4, 2, 32
cols = (heads + 2 * kv_heads) * d
for qk_norm in (False, True):
    y = torch.randn(n, cols + 16, generator=g)[:, :cols]  # a strided view, as the GEMM's
    s, b = torch.randn(n, S * W, generator=g), torch.randn(S * W, cols, generator=g) * 0.05
    slots = torch.tensor([2, -1, 0, 2, 1, -1])
    pos = torch.tensor([3.0, 17.0, 40.0, 5.0])
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    emb = torch.cat([pos[:, None] * inv] * 2, -1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    k_cache, v_cache = torch.randn(6, 4, kv_heads, d, generator=g), torch.zeros(6, 4, kv_heads, d)
    kv_slots = torch.tensor([5, 9, 0, 22])
    q_norm = 1 + 0.1 * torch.randn(d, generator=g) if qk_norm else None
    k_norm = 1 + 0.1 * torch.randn(d, generator=g) if qk_norm else None
    want_k, want_v = k_cache.clone(), v_cache.clone()
    rope = RopeKV(cos, sin, k_cache, v_cache, kv_slots, heads, kv_heads, q_norm, k_norm, 1e-5)
    out = torch.full((n, heads * d), 7.0)
    assert lora_expand_qkv(y, s, b, slots, S, rope, out) is out

    q, k, v = lora_rows(y, s, b, slots, S).view(n, -1, d).split([heads, kv_heads, kv_heads], 1)
    if qk_norm:
        q, k = rms_norm_reference(q, q_norm, 1e-5), rms_norm_reference(k, k_norm, 1e-5)
    want_k.view(-1, kv_heads, d)[kv_slots] = apply_rope(k, cos, sin)
    want_v.view(-1, kv_heads, d)[kv_slots] = v
    torch.testing.assert_close(out, q.reshape(n, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_cache, want_v, rtol=1e-5, atol=1e-5)
print("ok")
"""


@needs_triton
def test_the_qkv_expand_writes_the_cache_as_the_unfused_ops_under_the_interpreter():
    # What a CUDA LoRA decode step runs for its QKV group after the joint GEMM, on the CPU
    # through Triton's interpreter: the expand, the head norms, RoPE and the K/V write.
    _interpret(_INTERPRETED_QKV, timeout=300)


_INTERPRETED_SEGMENT = """
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[1])
from hf_models import cpu_engine, peft_greedy, write_adapter, write_checkpoint

import ostinato.engine.kernels.launch as launch
import ostinato.engine.model.decoder as decoder
import ostinato.engine.model.lora as lora
from ostinato.engine import SamplingParams
from ostinato.engine.kernels import small_gemm
from ostinato.engine.kernels.gemm_launch import GemmConfig
from ostinato.engine.kernels.lora_segment import LoraSegment
from ostinato.engine.kernels.rms_norm import Shrink, rms_norm_rows
from ostinato.engine.model.norm_op import rms_norm_reference
from ostinato.engine.model.rope import apply_rope

g = torch.Generator().manual_seed(0)
S = 3
slots = torch.tensor([2, -1, 0, 2, 1, -1, 0, 0, 1, 2, -1, 1, 0, 0, 2, 2, 1])


def expanded(x, weight, s, b, width):
    y = x.double() @ weight.double().t()
    for i in range(x.shape[0]):
        if slots[i] >= 0:
            j = int(slots[i])
            y[i] += s[i].double() @ b[j * width : (j + 1) * width].double()
    return y


# The GEMM with each row's expand before its epilogue (plain, SiLU-mul), float32 and
# float16 (tensor cores' path), unsplit, split and resident, against float64.
W, K, N = 24, 128, 64
for dtype in (torch.float32, torch.float16):
    for rows in (1, 5, 16):
        for config in (GemmConfig(32, 1), GemmConfig(32, 2, block_k=64),
                       GemmConfig(4, 1, resident=True)):  # fmt: skip
            for swiglu in ((False, True) if rows < 3 or not config.resident else ()):
                x = torch.randn(rows, K, generator=g).to(dtype)
                weight = (torch.randn(2 * N if swiglu else N, K, generator=g) * 0.1).to(dtype)
                s = torch.randn(rows, W, generator=g).to(dtype)
                b = (torch.randn(S * W, weight.shape[0], generator=g) * 0.1).to(dtype)
                counters = torch.zeros(64, dtype=torch.int32)
                segment = LoraSegment(s, b, slots, S)
                out = small_gemm.small_gemm(x, weight, None, counters, config, swiglu, lora=segment)
                y = expanded(x, weight, s, b, W)
                if swiglu:
                    gate, up = y[:, :N].to(dtype).double(), y[:, N:].to(dtype).double()
                    y = gate * torch.sigmoid(gate) * up
                err = (out.double() - y).abs().max().item()
                assert err < (1e-4 if dtype == torch.float32 else 3e-2), (config, swiglu, err)
                assert not counters.any()

# The QKV GEMM with each row's expand, then the head norms, RoPE and the K/V write.
W, n, heads, kv_heads, d, K = 24, 4, 4, 2, 32, 64
cols = (heads + 2 * kv_heads) * d
for config, qk_norm in ((GemmConfig(16, 2, block_k=32), False), (GemmConfig(16, 1), True),
                        (GemmConfig(4, 1, resident=True), False)):  # fmt: skip
    rows = 2 if config.resident else n
    x, weight = torch.randn(rows, K, generator=g), torch.randn(cols, K, generator=g) * 0.1
    s, b = torch.randn(rows, W, generator=g), torch.randn(S * W, cols, generator=g) * 0.05
    pos = torch.tensor([3.0, 17.0, 40.0, 5.0])[:rows]
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    emb = torch.cat([pos[:, None] * inv] * 2, -1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    k_cache, v_cache = torch.randn(6, 4, kv_heads, d, generator=g), torch.zeros(6, 4, kv_heads, d)
    kv_slots = torch.tensor([5, 9, 0, 22])[:rows]
    q_norm = 1 + 0.1 * torch.randn(d, generator=g) if qk_norm else None
    k_norm = 1 + 0.1 * torch.randn(d, generator=g) if qk_norm else None
    want_k, want_v = k_cache.clone(), v_cache.clone()
    caches = (k_cache, v_cache, kv_slots, heads, kv_heads)
    rope = small_gemm.RopeKV(cos, sin, *caches, q_norm, k_norm, 1e-5)
    out = torch.full((rows, heads * d), 7.0)
    counters = torch.zeros(64, dtype=torch.int32)
    segment = LoraSegment(s, b, slots, S)
    small_gemm.qkv_rope_kv(x, weight, None, counters, config, rope, out=out, lora=segment)
    y = expanded(x, weight, s, b, W).float()
    q, k, v = y.view(rows, -1, d).split([heads, kv_heads, kv_heads], 1)
    if qk_norm:
        q, k = rms_norm_reference(q, q_norm, 1e-5), rms_norm_reference(k, k_norm, 1e-5)
    want_k.view(-1, kv_heads, d)[kv_slots] = apply_rope(k, cos, sin)
    want_v.view(-1, kv_heads, d)[kv_slots] = v
    torch.testing.assert_close(out, q.reshape(rows, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_cache, want_v, rtol=1e-5, atol=1e-5)

# The norm that also shrinks each row for the projection after it (a few columns a
# program): the rows and the sum as without, the shrink the stored rows times A.
D = 256
for width, shrink_width, n in ((8, 48, 5), (0, 32, 3), (16, 16, 8)):
    x, res = torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)
    w = 1 + 0.1 * torch.randn(D, generator=g)
    a = torch.randn(S * shrink_width, D, generator=g) * 0.1
    delta = None
    if width:
        delta = (torch.randn(n, S * width, generator=g),
                 torch.randn(S * width, D, generator=g) * 0.05, slots, S)  # fmt: skip
    shrunk = torch.full((n, shrink_width), 7.0)
    out, total = torch.empty(n, D), torch.empty(n, D)
    rms_norm_rows(x, res, w, 1e-5, out, total, False, delta, Shrink(a, shrunk, slots, S))
    plain_out, plain_total = torch.empty(n, D), torch.empty(n, D)
    rms_norm_rows(x, res, w, 1e-5, plain_out, plain_total, False, delta)
    assert torch.equal(out, plain_out) and torch.equal(total, plain_total)
    want = torch.zeros(n, shrink_width)
    for i in range(n):
        if slots[i] >= 0:
            j = int(slots[i])
            want[i] = out[i] @ a[j * shrink_width : (j + 1) * shrink_width].t()
    torch.testing.assert_close(shrunk, want, rtol=1e-4, atol=1e-4)

# The engine on this path (as a CUDA decode step's 16-bit rows take it): PEFT's tokens.
kernel = lambda x: x.shape[0] <= 16 and not torch.compiler.is_compiling()
lora.expands_in_kernel = kernel
shrinks = []
decoder.shrinks_in_norm = lambda x: shrinks.append(kernel(x)) or shrinks[-1]
launch.num_sms = lambda device: 132
folder = Path(tempfile.mkdtemp())
hf = write_checkpoint("LlamaForCausalLM", folder)
adapters = {"a": write_adapter(hf, folder / "a", seed=1, rank=8),
            "b": write_adapter(hf, folder / "b", seed=2, rank=4, use_rslora=True)}
llm = cpu_engine(folder, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4)
for name in adapters:
    llm.load_lora(name, str(folder / name))
prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(12 + 5 * i)] for i in range(3)]
names = ["a", None, "b"]
outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), lora=names)
assert any(shrinks), shrinks
for prompt, name, o in zip(prompts, names, outs):
    reference = hf if name is None else adapters[name]
    assert o.token_ids == peft_greedy(reference, prompt, 8), name
print("ok")
"""


def _interprets_the_small_gemm() -> bool:
    """Triton installed, with NumPy 1: Triton 3.6's interpreter fails the small GEMM's K
    loop under NumPy 2."""
    if importlib.util.find_spec("triton") is None:
        return False
    import numpy

    return int(numpy.__version__.split(".")[0]) < 2


@pytest.mark.skipif(not _interprets_the_small_gemm(), reason="needs Triton and NumPy 1")
def test_the_shrink_in_the_norm_and_the_expand_in_the_gemm_equal_peft_under_the_interpreter():
    # A 16-bit CUDA decode step's QKV and gate/up groups: each row shrunk by the norm
    # before them, its expand added inside the GEMM before the epilogue; each kernel
    # against float64, then the engine on that path against PEFT, through Triton's
    # interpreter (float32, where the GPU's tensor cores take 16-bit rows).
    _interpret(_INTERPRETED_SEGMENT, timeout=600)
