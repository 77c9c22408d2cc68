"""The torch.compile(mode="reduce-overhead") baseline, gpt-fast style, on the same weights.

The KV cache is a pair of module buffers per layer (``[batch, kv_heads, max_len, d]``),
updated in place with ``index_copy_`` at the step's position, and attention is SDPA over
the whole cache with a mask up to that position: the setup in which reduce-overhead
records CUDA graphs. It shares the ``DecoderModel``'s parameters, so both compute the
same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class StaticCacheDecoder(nn.Module):
    """``forward(input_ids [B, 1], input_pos [1]) -> logits [B, vocab]`` for decode steps."""

    def __init__(self, model: nn.Module, batch: int, max_len: int) -> None:
        """``model``: the engine's decoder (``llm.engine.model``), whose weights it reads."""
        super().__init__()
        self.model = model
        c = model.config
        dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
        shape = (batch, c.num_kv_heads, max_len, c.head_dim)
        for i in range(c.num_layers):
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=dtype, device=device))
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=dtype, device=device))
        self.max_len = max_len

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        m = self.model
        b = input_ids.shape[0]
        x = m.embed_tokens(input_ids[:, 0])
        freqs = input_pos.float()[:, None] * m.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = (torch.arange(self.max_len, device=x.device) <= input_pos)[None, None, None, :]
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = attn.project(h, cos, sin)
            kc, vc = getattr(self, f"k{i}"), getattr(self, f"v{i}")
            kc.index_copy_(2, input_pos, k[:, :, None, :])
            vc.index_copy_(2, input_pos, v[:, :, None, :])
            o = F.scaled_dot_product_attention(
                q[:, :, None, :], kc, vc, attn_mask=mask, scale=attn.scale, enable_gqa=True
            )
            x = x + attn.o_proj(o.reshape(b, attn.q_size))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.compute_logits(m.norm(x))
