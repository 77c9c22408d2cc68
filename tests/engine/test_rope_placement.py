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
from ostinato.engine import LLM, SamplingParams
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
    assert not plain.model.rope_in_attention and fused.model.rope_in_attention
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
