"""RoPE in the model or inside the attention op (``backend.applies_rope``): the model
hands q and k over unrotated with cos and sin, and the backend rotates them. On the CPU
the torch backend rotates with the model's own function, so both placements must give
the same numbers, eagerly and through the piecewise-compiled model (the GPU kernels'
rotation: tests/test_gpu_engine.py)."""

from dataclasses import replace

import pytest
import torch

from benchmarks.decode import BenchConfig, DecodeSetup
from ostinato.config import GraphConfig
from ostinato.engine import LLM, KernelOptions, SamplingParams
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.model.attention import TorchAttention
from ostinato.engine.model.presets import shape
from ostinato.engine.worker.runner import ModelRunner
from ostinato.modes import GraphMode

PROMPTS = [[(5 * i + 1) % 97 + 3 for i in range(40)], [7, 8, 9]]


def test_the_engine_generates_the_same_with_rope_in_the_attention_backend():
    kw = dict(device="cpu", dtype=torch.float32, max_model_len=96, progress=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = LLM("tiny", **kw)
    fused = LLM("tiny", backend=TorchAttention(applies_rope=True), **kw)
    assert not plain.engine.model.rope_in_attention and fused.engine.model.rope_in_attention
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.token_ids for o in fused.generate(PROMPTS, params)] == want


@pytest.mark.parametrize("compiler", [None, "inductor"])
def test_a_decode_step_is_bitwise_the_same_with_rope_in_the_backend(compiler):
    # The piecewise-compiled model traces the op with its cos/sin arguments and splits
    # there; the compiled rotation may round differently from the eager one, so the
    # compiled model is compared with itself across placements only to a tolerance.
    cfg = replace(BenchConfig(model=shape("tiny")), batch_sizes=(4,), kv_len=40, dtype="float32")
    setup = DecodeSetup(cfg, torch.device("cpu"))
    step = setup.decode_batch([3, 5, 7, 11])
    limits = EngineLimits(4, 64, setup.max_len, 16)
    outs = []
    for backend in (TorchAttention(), TorchAttention(applies_rope=True)):
        runner = ModelRunner(
            setup.model,
            setup.cache,
            backend,
            limits,
            GraphConfig(mode=GraphMode.NONE),
            torch.device("cpu"),
            progress=False,
            compiler=compiler,
        )
        with torch.inference_mode():
            runner.compile()
            outs.append(runner.execute(step).logits.clone())
        runner.release()
    if compiler is None:
        assert torch.equal(outs[0], outs[1])
    else:
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_the_norm_ops_compute_transformers_arithmetic_and_refuse_a_mismatched_residual():
    from ostinato.engine.model.norm_op import add_rms_norm_reference

    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    total = x + r
    want = w * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5))
    got, got_total = torch.ops.ostinato.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(got_total, total)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.ops.ostinato.rms_norm(total, w, 1e-5), want)
    for bad in (torch.randn(1, 8), torch.randn(3, 8, dtype=torch.float64)):
        with pytest.raises(ValueError, match="add_rms_norm: x .* and residual .* must match"):
            add_rms_norm_reference(x, bad, w, 1e-5)


def test_rope_frequencies_are_made_where_the_model_is():
    # Computed on the CPU (no torch._refs import), then placed on the model's device,
    # a torch.device context included.
    from ostinato.engine.model.config import ModelConfig
    from ostinato.engine.model.decoder import DecoderModel
    from ostinato.engine.model.presets import SHAPES

    with torch.device("meta"):
        model = DecoderModel(ModelConfig.from_hf(SHAPES["tiny"]))
    assert model.inv_freq.device.type == "meta"
    assert DecoderModel(ModelConfig.from_hf(SHAPES["tiny"])).inv_freq.device.type == "cpu"


def test_a_model_made_on_a_device_holds_drawn_weights_and_one_made_on_meta_is_unmade():
    # Benchmarks and tests build DecoderModel directly on the CPU; an embedding table left
    # as torch.empty there read whatever the allocator held (NaN logits, now and then).
    from ostinato.engine.model.config import ModelConfig
    from ostinato.engine.model.decoder import DecoderModel
    from ostinato.engine.model.presets import SHAPES

    config = ModelConfig.from_hf(SHAPES["tiny"])
    torch.manual_seed(0)
    table = DecoderModel(config).embed_tokens.weight
    assert torch.isfinite(table).all()
    assert abs(table.std().item() - 1.0) < 0.05 and abs(table.mean().item()) < 0.05
    torch.manual_seed(0)
    assert torch.equal(DecoderModel(config).embed_tokens.weight, table)  # seeded: one model
    with torch.device("meta"):
        assert DecoderModel(config).embed_tokens.weight.device.type == "meta"


def test_the_rope_table_gives_each_position_the_computed_cos_and_sin_bitwise():
    # One lookup a step instead of six kernels: the table must hold exactly what the
    # step would compute, in the weights' dtype, made again when the model moves.
    from ostinato.engine.model.config import ModelConfig
    from ostinato.engine.model.decoder import DecoderModel
    from ostinato.engine.model.presets import SHAPES
    from ostinato.engine.model.rope import rope_cos_sin

    config = ModelConfig.from_hf(SHAPES["tiny"])
    with torch.device("meta"):
        model = DecoderModel(config, max_positions=300)
    assert model.rope_table is None  # nothing to compute on meta
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    assert model.rope_table.shape == (300, 2, 1, config.head_dim)
    positions = torch.tensor([0, 1, 7, 299, 123, 299, 5])
    for dtype in (torch.bfloat16, torch.float32):  # float32: not the table's, computed
        cos, sin = model.rope(positions, dtype)
        want_cos, want_sin = rope_cos_sin(positions, model.inv_freq, dtype)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert cos.dtype == sin.dtype == dtype and cos.shape == (7, 1, config.head_dim)
    # a padding row (-1) reads a row, whatever it holds, rather than failing
    assert model.rope(torch.tensor([-1, 3]), torch.bfloat16)[0].shape[0] == 2
    with pytest.raises(IndexError):  # past the bound: an error on the CPU, never a value
        model.rope(torch.tensor([300]), torch.bfloat16)
    direct = DecoderModel(config, max_positions=8)  # made on a device: the table at once
    assert torch.equal(
        direct.rope(torch.arange(8), torch.float32)[1],
        rope_cos_sin(torch.arange(8), direct.inv_freq, torch.float32)[1],
    )
    with pytest.raises(ValueError, match="max_positions must be >= 1"):
        DecoderModel(config, max_positions=0)


def test_the_engine_model_holds_a_table_of_max_model_len_positions():
    llm = LLM("tiny", device="cpu", dtype=torch.float32, max_model_len=48, progress=False)
    assert llm.engine.model.rope_table.shape[0] == 48
    # generating up to the limit, every position stays within the table
    out = llm.generate([[3] * 40], SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(out[0].prompt_token_ids) + len(out[0].token_ids) == 48


def test_a_step_takes_its_embedding_and_rope_rows_from_one_op_with_the_lookups_bits():
    # ``ostinato::embed_rope`` (eagerly, one rank, the table in the weights' dtype) and
    # the two lookups it replaces give the same rows; its checks name the shapes.
    from unittest import mock

    from ostinato.engine.kernels.launch_rules import LaunchRules, rules_in_force
    from ostinato.engine.model import decoder
    from ostinato.engine.model.config import ModelConfig
    from ostinato.engine.model.presets import SHAPES

    model = decoder.DecoderModel(ModelConfig.from_hf(SHAPES["tiny"]), max_positions=64)
    ids, positions = torch.tensor([3, 9, 0, 5]), torch.tensor([1, 63, -1, 7])
    with mock.patch.object(
        torch.ops.ostinato, "embed_rope", wraps=torch.ops.ostinato.embed_rope
    ) as op:
        one = model._inputs(ids, positions)
        with rules_in_force(LaunchRules(embed_rope=False)):
            two = model._inputs(ids, positions)
    assert op.call_count == 1
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    assert torch.equal(one[0], model.embed(ids))
    with pytest.raises(ValueError, match="embed_rope: needs ids and positions"):
        torch.ops.ostinato.embed_rope(
            ids, positions[:2], model.embed_tokens.weight, model.rope_table
        )


def test_a_vocabulary_shard_s_embed_rope_rows_are_its_own_rows_and_zeros_elsewhere():
    # Under tensor parallelism each rank looks up its shard of the vocabulary (the op's
    # ``vocab_start``); the sum over ranks is then the whole table's lookup.
    embed, table = torch.randn(12, 6), torch.randn(16, 2, 1, 4)
    ids, positions = torch.tensor([0, 5, 6, 11, 3]), torch.tensor([0, 1, 2, 3, -1])
    parts = [
        torch.ops.ostinato.embed_rope(ids, positions, embed[start : start + 6], table, False, start)
        for start in (0, 6)
    ]
    for start, (x, rows) in zip((0, 6), parts, strict=True):
        mine = (ids >= start) & (ids < start + 6)
        assert torch.equal(x[mine], embed[ids[mine]]) and not x[~mine].any()
        assert torch.equal(rows, table[positions])
    assert torch.equal(parts[0][0] + parts[1][0], embed[ids])


def test_an_unfused_layer_hands_its_qkv_rows_to_one_kernel_where_the_rule_says(monkeypatch):
    # ``LaunchRules.rope_kv_unfused``: where the fused layers' QKV kernel can run (CUDA,
    # the Triton backend: faked here), an unfused layer's QKV projection, K/V write and
    # query heads come from it, called without a norm; the attention op then takes the
    # queries alone. A CPU double of the kernel with the unfused arithmetic: the logits
    # are the rule-off step's bits, and it ran once a layer.
    import torch.nn.functional as F

    from ostinato.context import get_forward_context
    from ostinato.engine.kernels.launch_rules import LaunchRules, rules_in_force
    from ostinato.engine.model import fused_ops

    calls: list[int] = []

    def kernel(x, weight, bias, counters, heads, cos, sin, prologue, pdl, out, config):
        assert prologue is None and config is not None  # (the projection's own launch)
        step = get_forward_context().attn_metadata
        k_cache, v_cache = step.cache.k[heads.layer], step.cache.v[heads.layer]
        n, d = x.shape[0], k_cache.shape[-1]
        sizes = [heads.q_heads * d, heads.kv_heads * d, heads.kv_heads * d]
        q, k, v = F.linear(x, weight, bias).split(sizes, -1)
        k, v = k.reshape(n, -1, d), v.reshape(n, -1, d)
        step.backend.write_kv(k, v, k_cache, v_cache, step.metadata.slot_mapping, (cos, sin))
        out.copy_(q)
        calls.append(heads.layer)

    monkeypatch.setattr(fused_ops, "_fuses_qkv", lambda *args: True)
    monkeypatch.setattr(fused_ops, "kernel_rows", lambda *args: 1)  # (a plan's first entry)
    monkeypatch.setattr(fused_ops, "_rope_kv_kernel", kernel)
    cfg = replace(BenchConfig(model=shape("tiny")), batch_sizes=(4,), kv_len=40, dtype="float32")
    setup = DecodeSetup(cfg, torch.device("cpu"))
    step = setup.decode_batch([3, 5, 7, 11])
    unfused, backend = KernelOptions(fused_layers=False), TorchAttention(applies_rope=True)
    outs = []
    for rule in (True, False):
        with rules_in_force(LaunchRules(rope_kv_unfused=rule)):
            runner = setup.runner(GraphMode.NONE, None, backend, unfused)
            with torch.inference_mode():
                outs.append(runner.execute(step).logits.clone())
            runner.release()
    assert calls == list(range(setup.config.num_layers))  # (with the rule on only)
    assert torch.equal(outs[0], outs[1])


def test_the_embed_rope_op_compiled_equals_it_eager():
    # Compiled models keep the two lookups, but the op stays traceable: its fake
    # implementation must describe the real outputs for compiled callers.
    from torch._inductor.utils import fresh_inductor_cache

    def f(ids, positions, embed, table):
        x, rows = torch.ops.ostinato.embed_rope(ids, positions, embed, table)
        return x * 2, rows + 1

    args = (
        torch.tensor([3, 0, 7]),
        torch.tensor([5, -1, 2]),
        torch.randn(9, 16),
        torch.randn(8, 2, 1, 4),
    )
    with fresh_inductor_cache():
        got = torch.compile(f, backend="inductor", fullgraph=True)(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, f(*args), strict=True))
