"""ModelConfig.from_hf: both transformers layouts, and a named refusal of what the engine
does not implement (no silent default for a field the file sets)."""

import json

import pytest

from ostinato.engine.model.config import ModelConfig, ModelConfigError
from ostinato.engine.model.presets import shape

BASE = shape("tiny")


def cfg(**changes):
    return ModelConfig.from_hf({**{k: v for k, v in BASE.items() if k != "rope_theta"}, **changes})


def test_theta_from_either_layout():
    assert cfg(rope_theta=1e6).rope_theta == 1e6
    assert cfg(rope_parameters={"rope_theta": 1e6, "rope_type": "default"}).rope_theta == 1e6
    assert cfg().rope_theta == 10000.0  # neither given: the transformers default


def test_llama3_scaling_from_either_layout():
    llama3 = dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    v5 = cfg(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **llama3})
    v4 = cfg(rope_theta=5e5, rope_scaling={"rope_type": "llama3", **llama3})
    old = cfg(rope_theta=5e5, rope_scaling={"type": "llama3", **llama3})
    assert v5 == v4 == old and v5.rope_scaling.factor == 8.0 and v5.rope_theta == 5e5


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type: 'yarn'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type: 'linear'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type: 'dynamic'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "missing"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary"),
        ({"rope_parameters": {"rope_theta": 1e4, "factor": 2.0}}, "would ignore"),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}}}, "per-layer-type"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "sliding-window"),
        ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "sliding-window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        ({"num_key_value_heads": 3}, "does not divide"),
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"vocab_size": "many"}, "wrong type"),
    ],
)
def test_unsupported_fields_are_refused_by_name(changes, message):
    with pytest.raises(ModelConfigError, match=message):
        cfg(**changes)


def test_attention_bias_reaches_every_projection_of_llama():
    c = cfg(attention_bias=True)
    assert c.qkv_bias and c.o_bias
    q2 = ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert q2.qkv_bias and not q2.o_bias


def test_from_dir_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"config\.json: not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "hidden_act": "relu"}))
    with pytest.raises(ModelConfigError, match=r"config\.json: hidden_act"):
        ModelConfig.from_dir(tmp_path)
