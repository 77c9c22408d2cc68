"""Model configuration: the shape of a Llama-family decoder, read from a checkpoint's config.

``ModelConfig.from_hf`` reads every field of a Hugging Face ``config.json`` that changes
the function the model computes, in the layouts that transformers 4.x and 5.x write, and
refuses (``ModelConfigError``, naming the field) what the engine does not implement.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# RoPE keys transformers writes beside the type; any other key in a RoPE dict is refused
# because it would change the function in a way the engine does not implement.
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_ROPE_BOOKKEEPING = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


_POSITIVE = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)


class ModelConfigError(ValueError):
    """A model configuration the engine cannot run; the message names the field and fix."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling (the only RoPE scaling the engine implements)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder.

    Covers Llama 3 (GQA, RoPE theta, Llama 3 scaling, optional attention bias on q, k, v
    and o), Qwen2 (bias on q, k, v) and Qwen3 (RMSNorm on q and k per head).
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool = False
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_key_value_heads: {self.num_kv_heads} does not divide "
                f"num_attention_heads={self.num_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout).

        Raises ``ModelConfigError`` for an unknown architecture, a missing field, or a
        field whose value the engine does not implement (RoPE types other than default
        and llama3, partial rotary factors, sliding-window attention, activations other
        than SiLU, MLP bias, quantized checkpoints).
        """
        if not isinstance(hf, dict):
            raise ModelConfigError(f"config: expected a JSON object, got {type(hf).__name__}")
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"architectures: {archs or 'none given'} not supported; the engine runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _refuse_unsupported(hf)
        theta, scaling = _rope(hf)
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            attention_bias = bool(hf.get("attention_bias", False))
            return cls(
                architecture=arch,
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                vocab_size=int(hf["vocab_size"]),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v bias and never o bias; Llama and Qwen3 put
                # attention_bias on all four projections.
                qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
                o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
                qk_norm=arch == "Qwen3ForCausalLM",
                rope_scaling=scaling,
            )
        except KeyError as exc:
            raise ModelConfigError(f"config: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(
                f"config: a field has a value of the wrong type: {exc}"
            ) from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Reads ``config.json`` from a model directory; errors name the file."""
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ModelConfigError(f"model directory {path}: no config.json found")
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelConfigError(f"{p}: not valid JSON ({exc})") from None
        try:
            return cls.from_hf(data)
        except ModelConfigError as exc:
            raise ModelConfigError(f"{p}: {exc}") from None


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"hidden_act: {act!r} not supported; the engine implements 'silu'")
    if hf.get("mlp_bias"):
        raise ModelConfigError("mlp_bias: true is not supported; the engine's MLP has no bias")
    if hf.get("use_sliding_window") or any(
        kind != "full_attention" for kind in hf.get("layer_types") or []
    ):
        raise ModelConfigError(
            "sliding-window attention (use_sliding_window / layer_types) is not supported; "
            "the engine attends to the full sequence"
        )
    if hf.get("quantization_config"):
        raise ModelConfigError(
            "quantization_config: quantized safetensors checkpoints are not supported; "
            "use an unquantized checkpoint or a GGUF file"
        )
    pretraining_tp = hf.get("pretraining_tp", 1)
    if pretraining_tp not in (None, 1):
        raise ModelConfigError(f"pretraining_tp: {pretraining_tp} not supported; only 1")


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from ``rope_parameters`` (transformers 5) or the top-level
    ``rope_theta`` / ``rope_scaling`` (transformers 4)."""
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise ModelConfigError(
                "rope_parameters: per-layer-type RoPE settings are not supported"
            )
        rope = dict(params)
        if "rope_theta" not in rope and "rope_theta" in hf:
            rope["rope_theta"] = hf["rope_theta"]
    else:
        rope = dict(hf.get("rope_scaling") or {})
        if "rope_theta" in hf:
            rope["rope_theta"] = hf["rope_theta"]
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor is not None and float(factor) != 1.0:
        raise ModelConfigError(
            f"partial_rotary_factor: {factor} not supported; the engine rotates the whole head"
        )
    theta = float(rope.get("rope_theta", 10000.0))
    if not math.isfinite(theta) or theta <= 0:
        raise ModelConfigError(f"rope_theta: must be a positive number, got {theta}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        extra = set(rope) - _ROPE_BOOKKEEPING
        if extra:
            raise ModelConfigError(
                f"rope: keys {sorted(extra)} given with rope_type 'default'; the engine "
                "would ignore them"
            )
        return theta, None
    if kind != "llama3":
        raise ModelConfigError(
            f"rope_type: {kind!r} not supported; the engine implements 'default' and 'llama3'"
        )
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
        raise ModelConfigError(f"rope_type 'llama3': missing {missing}")
    return theta, RopeScaling(
        float(rope["factor"]),
        float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]),
    )
