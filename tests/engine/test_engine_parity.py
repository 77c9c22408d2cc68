"""Our decoder vs Hugging Face transformers on the same random weights (CPU, float32).

Every checkpoint uses a non-default RoPE theta (and one Llama 3 scaling), in both config
layouts: transformers 5's ``rope_parameters`` and transformers 4's top-level
``rope_theta`` / ``rope_scaling``. Prompts are long enough that positions matter.
"""

import json

import pytest
import torch
from hf_models import assert_greedy_matches_hf, write_checkpoint

from ostinato.engine import LLM, ModelConfig, SamplingParams

transformers = pytest.importorskip("transformers")

LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
CASES = {
    "llama": ("LlamaForCausalLM", dict(rope_theta=500000.0)),
    "llama3-scaling": ("LlamaForCausalLM", dict(rope_parameters=LLAMA3)),
    "llama-bias": ("LlamaForCausalLM", dict(rope_theta=500000.0, attention_bias=True)),
    "qwen2": ("Qwen2ForCausalLM", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", dict(rope_theta=1000000.0)),
}


def to_v4_layout(folder):
    """Rewrites config.json the way transformers 4 wrote it (no rope_parameters)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    path.write_text(json.dumps(cfg))


@pytest.fixture(params=[(c, layout) for c in CASES for layout in ("v5", "v4")], ids=str)
def checkpoint(request, tmp_path):
    case, layout = request.param
    arch, overrides = CASES[case]
    hf = write_checkpoint(arch, tmp_path, **overrides)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    if layout == "v4":
        to_v4_layout(tmp_path)
    return arch, hf, tmp_path


def _llm(path, **kw):
    return LLM(
        path,
        device="cpu",
        dtype=torch.float32,
        max_model_len=256,
        max_num_seqs=8,
        progress=False,
        **kw,
    )


def test_config_read_from_checkpoint(checkpoint):
    arch, hf, path = checkpoint
    cfg = ModelConfig.from_dir(path)
    assert cfg.architecture == arch
    bias = bool(getattr(hf.config, "attention_bias", False))
    assert cfg.qkv_bias is (arch == "Qwen2ForCausalLM" or bias)
    assert cfg.o_bias is (arch != "Qwen2ForCausalLM" and bias)
    assert cfg.qk_norm is (arch == "Qwen3ForCausalLM")
    assert cfg.tie_word_embeddings is (arch == "Qwen2ForCausalLM")
    assert cfg.rope_theta == hf.config.rope_parameters["rope_theta"] != 10000.0
    assert (cfg.rope_scaling is not None) is (
        hf.config.rope_parameters.get("rope_type") == "llama3"
    )


def test_last_token_logits_match_hf(checkpoint):
    arch, hf, path = checkpoint
    llm = _llm(path)
    prompts = [[1, 5, 9, 200, 3], [7], [(13 * i + 5) % 512 for i in range(150)]]
    reqs = [llm.engine.scheduler.add(p, SamplingParams()) for p in prompts]
    step = llm.engine.scheduler.schedule()
    assert [s.request for s in step.scheduled] == reqs
    ours = llm.engine.runner.execute(step).logits
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(ours[i], want, atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_hf_generate(checkpoint):
    arch, hf, path = checkpoint
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [(11 * i + 2) % 512 for i in range(90)]]
    assert_greedy_matches_hf(_llm(path), hf, prompts, max_tokens=12)
