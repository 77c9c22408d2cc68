"""Model and engine configuration for the reference engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# The embedded default: a small Llama-shaped model, random weights, runs anywhere.
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face ``config.json``.

    Covers Llama 3 (GQA, RoPE theta), Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on q and
    k per head). ``from_hf`` raises ``ValueError`` for an unknown architecture or a
    missing field, naming it.
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
    rope_scaling: tuple[tuple[str, Any], ...] | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads a Hugging Face ``config.json`` dict."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"architectures: {archs or 'none given'} not supported; the engine runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        scaling = hf.get("rope_scaling")
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("default", "llama3"):
                raise ValueError(
                    f"rope_scaling: type {kind!r} not supported; the engine implements "
                    "'default' and 'llama3'"
                )
            scaling = None if kind == "default" else tuple(sorted(scaling.items()))
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
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
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch == "Qwen3ForCausalLM",
                rope_scaling=scaling or None,
            )
        except KeyError as exc:
            raise ValueError(f"config.json: missing field {exc.args[0]!r}") from exc

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Reads ``config.json`` from a model directory."""
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ValueError(f"model directory {path}: no config.json found")
        return cls.from_hf(json.loads(p.read_text()))

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (for reports)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
