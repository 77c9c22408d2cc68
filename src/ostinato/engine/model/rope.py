"""Rotary position embedding (RoPE): the frequencies, with Llama 3 scaling, and the
rotation in the rotate-half convention of Llama and Qwen, as transformers computes them."""

from __future__ import annotations

import math

import torch

from ostinato.engine.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies for RoPE, with Llama 3 frequency scaling when configured; a
    float32 CPU tensor (computed there even inside ``torch.device("meta")``, where these
    ops would go through torch._refs and import Dynamo: seconds)."""
    d = config.head_dim
    steps = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float()
    inv = 1.0 / (config.rope_theta ** (steps / d))
    if config.rope_scaling is None:
        return inv
    s = config.rope_scaling
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    old_len = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[n, 1, head_dim]`` in ``dtype`` for ``positions`` (``[n]``): the
    angles in float32, as transformers computes them, then rounded once."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_table(inv_freq: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """``[length, 2, 1, head_dim]``: ``rope_cos_sin`` of positions ``0 .. length - 1``
    (the same ops elementwise, so equal bitwise), cos then sin, on ``inv_freq``'s
    device."""
    positions = torch.arange(length, device=inv_freq.device)
    return torch.stack(rope_cos_sin(positions, inv_freq, dtype), dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention (Llama / Qwen)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
