"""Attention as the custom op ``ostinato::attention``, opaque to torch.compile.

The op writes this step's K/V into the layer's cache and the attention output into
``out`` in place; given ``cos`` and ``sin`` it gets q and k unrotated and the backend
applies RoPE (to k as it writes the cache, to q as it attends). Without ``k`` and ``v``
the cache already holds the step's keys and values and ``q`` is the rows
``ostinato::norm_qkv`` wrote (queries first); q is still rotated here, by the backend
or, for one that does not apply RoPE, in torch.
Everything step-specific (metadata, cache, backend) comes from the forward context at run
time, so a compiled graph that calls the op stays valid for every batch, and the
piecewise backend splits the graph exactly here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.context import get_forward_context
from ostinato.engine.core.kv_cache import KVCache
from ostinato.engine.model.attention import AttentionBackend, AttentionMetadata
from ostinato.engine.model.rope import apply_rope


@dataclass
class StepAttention:
    """The forward context's ``attn_metadata`` for the engine: metadata, cache, backend."""

    metadata: AttentionMetadata
    cache: KVCache
    backend: AttentionBackend


# Registered through torch.library.Library rather than the custom_op decorator: the
# decorator's Python dispatch wrapper costs about 5x more host time per call, paid once
# per layer on every step that runs attention eagerly (NONE and PIECEWISE).
_lib = torch.library.Library("ostinato", "DEF")
_lib.define(
    "attention(Tensor q, Tensor? k, Tensor? v, Tensor(a!) out, int layer, float scale, "
    "Tensor? cos=None, Tensor? sin=None) -> ()"
)


def attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    out: torch.Tensor,
    layer: int,
    scale: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> None:
    """``out[:] = attention(q)`` over layer ``layer``'s cache after writing ``k, v`` to it
    when given (q and k rotated by ``cos, sin`` first, when given)."""
    step: StepAttention = get_forward_context().attn_metadata
    k_cache, v_cache = step.cache.k[layer], step.cache.v[layer]
    rope = None if cos is None or sin is None else (cos, sin)
    if k is not None and v is not None:
        step.backend.write_kv(k, v, k_cache, v_cache, step.metadata.slot_mapping, rope)
    else:  # q: the rows ostinato::norm_qkv wrote, the queries first
        n, heads, d = out.shape
        q = q[:, : heads * d].view(n, heads, d)
        if rope is not None and not step.backend.applies_rope:
            q, rope = apply_rope(q, *rope), None
    step.backend(q, k_cache, v_cache, step.metadata, scale, out, rope)  # straight into out


_lib.impl("attention", attention, "CompositeExplicitAutograd")


@torch.library.register_fake("ostinato::attention", lib=_lib)
def _(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    out: torch.Tensor,
    layer: int,
    scale: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> None:
    return None
