"""Loading Hugging Face safetensors checkpoints into ``DecoderModel`` (local files only)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ostinato.engine.model import DecoderModel

# HF name suffix -> (our parameter suffix, shard index within a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def load_weights(model: DecoderModel, model_dir: str | Path) -> list[str]:
    """Copies every tensor of ``model_dir/*.safetensors`` into ``model``.

    Returns the names of checkpoint tensors that were not used (e.g. rotary caches).
    Raises ``ValueError`` naming any model parameter the checkpoint did not provide,
    and on any shape mismatch.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir}: no *.safetensors files")
    params = dict(model.named_parameters())
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused_splits = {
        "self_attn.qkv_proj": [q, kv, kv],
        "mlp.gate_up_proj": [cfg.intermediate_size] * 2,
    }
    loaded: set[str] = set()
    unused: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                target, shard = _target(name)
                if target not in params:
                    unused.append(name)
                    continue
                tensor = st.get_tensor(name)
                param = params[target]
                dest = param.data
                if shard is not None:
                    sizes = fused_splits[_layer_module(target)]
                    dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
                if dest.shape != tensor.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} does not match "
                        f"model shape {tuple(dest.shape)} (is config.json from this checkpoint?)"
                    )
                with torch.no_grad():
                    dest.copy_(tensor)
                loaded.add(f"{target}#{shard}")
    if cfg.tie_word_embeddings:
        loaded.add("lm_head.weight#None")
    missing = []
    for pname in params:
        module = _layer_module(pname)
        shards = range(len(fused_splits[module])) if module in fused_splits else [None]
        missing += [
            f"{pname}[{s}]" if s is not None else pname
            for s in shards
            if f"{pname}#{s}" not in loaded
        ]
    if missing:
        raise ValueError(
            f"checkpoint in {model_dir} lacks {missing[:8]}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )
    return unused


def _target(hf_name: str) -> tuple[str, int | None]:
    m = _LAYER.match(hf_name)
    if m:
        layer, module, kind = m.groups()
        if module in _FUSED:
            ours, shard = _FUSED[module]
            return f"layers.{layer}.{ours}.{kind}", shard
        return f"layers.{layer}.{module}.{kind}", None
    if hf_name.startswith("model."):
        return hf_name[len("model.") :], None
    return hf_name, None


def _layer_module(param_name: str) -> str:
    """``layers.3.self_attn.qkv_proj.weight`` -> ``self_attn.qkv_proj``; else ''."""
    parts = param_name.split(".")
    return ".".join(parts[2:-1]) if parts[0] == "layers" else ""
