"""Paged attention: metadata for a step, writing K/V into the cache, and two backends.

``TritonAttention`` (CUDA) runs one kernel for prefill, decode and mixed batches that
takes every piece of metadata from device buffers, so it can be captured in a FULL
graph for any batch (support level ALWAYS). ``TorchAttention`` gathers each request's
KV and runs SDPA per request: the CPU path and the reference; it reads host-side lengths,
so it is never captured (support level NEVER).

A backend with ``applies_rope`` receives q and k unrotated with ``rope = (cos, sin)`` and
rotates them itself; every backend accepts ``rope`` (the torch backend rotates with the
model's own ``apply_rope``, so both placements compute the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from ostinato.engine.model.rope import apply_rope
from ostinato.mathutil import ceil_div
from ostinato.resolution import AttentionGraphSupport


@dataclass
class AttentionMetadata:
    """What attention needs for one step. Device tensors are views of the runner's
    persistent buffers (fixed addresses); host lists are for the torch backend only.

    Per token: ``positions`` (absolute; -1 marks a padding row, which attends to nothing
    and whose output is zero), ``token_req`` (row of ``block_tables``), ``slot_mapping``
    (flat cache slot its K/V is written to; padding rows write to the null block).
    ``new_keys``: a bound on the step's query lengths (0: none given), so a token's keys
    written by this step are its position and at most ``new_keys - 1`` before it; a
    backend may read the older ones before the K/V write has finished.
    """

    positions: torch.Tensor
    token_req: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    new_keys: int = 0


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [n, 1, head_dim], the step's rows


class AttentionBackend(Protocol):
    """Attention over the paged cache for one step, written into ``out`` (``q``'s shape);
    ``graph_support`` says what can be captured; ``applies_rope`` whether the model
    should hand q and k over unrotated (with ``rope``)."""

    graph_support: AttentionGraphSupport
    applies_rope: bool

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        rope: Rope | None = None,
    ) -> None: ...

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        rope: Rope | None = None,
    ) -> None:
        """Stores the step's keys (rotated by ``rope`` if given) and values at their slots
        (before ``__call__``)."""


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope: Rope | None = None,
) -> None:
    """Stores this step's keys (rotated by ``rope`` if given) and values
    (``[n, kv_heads, head_dim]``) at their slots."""
    if rope is not None:
        k = apply_rope(k, *rope)
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TorchAttention:
    """Per-request SDPA over KV gathered from the paged cache (host-side lengths).
    ``applies_rope``: ask the model for unrotated q and k (the same numbers either way;
    the CPU tests use it to run the model's side of the fused path)."""

    graph_support = AttentionGraphSupport.NEVER
    write_kv = staticmethod(write_kv)

    def __init__(self, applies_rope: bool = False) -> None:
        self.applies_rope = applies_rope

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        rope: Rope | None = None,
    ) -> None:
        if rope is not None:
            q = apply_rope(q, *rope)
        out.zero_()  # padding rows, and rows of no request, output zeros
        block_size = k_cache.shape[1]
        heads, kv_heads = q.shape[1], k_cache.shape[2]
        tables = meta.block_tables.tolist()
        # Each request's length from its last row's position, as the kernels read it.
        positions = meta.positions.tolist()
        start = 0
        for r, qlen in enumerate(meta.query_lens):
            slen = positions[start + qlen - 1] + 1
            blocks = torch.tensor(tables[r][: ceil_div(slen, block_size)], device=q.device)
            k = k_cache[blocks].flatten(0, 1)[:slen]  # [slen, kv_heads, d]
            v = v_cache[blocks].flatten(0, 1)[:slen]
            qr = q[start : start + qlen].transpose(0, 1)  # [heads, qlen, d]
            k = k.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
            v = v.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
            # Query i sits at position slen - qlen + i and sees keys 0..that position.
            mask = torch.ones(qlen, slen, dtype=torch.bool, device=q.device).tril(slen - qlen)
            o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale)
            out[start : start + qlen] = o.transpose(0, 1)
            start += qlen


class TritonAttention:
    """The graph-safe paged attention kernel (``triton_attention.paged_attention``).

    ``fused`` (the default): K and V are stored by one Triton kernel that also rotates K,
    and the attention kernel rotates q as it loads it (``applies_rope``), so a layer has
    no RoPE kernels and no copies; without it, RoPE runs in the model and the K/V writes
    are two ``index_copy_`` (kept to measure the difference). ``pdl``: both kernels are
    launched with programmatic dependent launch (``KernelOptions.pdl``)."""

    graph_support = AttentionGraphSupport.ALWAYS

    def __init__(self, fused: bool = True, pdl: bool = False) -> None:
        self.applies_rope = fused
        # Programmatic dependent launch for both kernels (compute capability 9.0+); the
        # runner sets it from its KernelOptions.
        self.pdl = pdl

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        rope: Rope | None = None,
    ) -> None:
        """One Triton kernel (rotating K) when fused, else two ``index_copy_``."""
        if not self.applies_rope:
            write_kv(k, v, k_cache, v_cache, slot_mapping, rope)
            return
        from ostinato.engine.kernels.paged_attention import write_kv_fused

        write_kv_fused(k, v, k_cache, v_cache, slot_mapping, rope, pdl=self.pdl)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        rope: Rope | None = None,
    ) -> None:
        from ostinato.engine.kernels.paged_attention import paged_attention

        paged_attention(
            q,
            k_cache,
            v_cache,
            meta.positions,
            meta.token_req,
            meta.block_tables,
            scale,
            out=out,
            rope=rope,
            pdl=self.pdl,
            new_keys=meta.new_keys,
        )
