"""Paged attention: metadata for a step, writing K/V into the cache, and two backends.

``TritonAttention`` (CUDA) runs one kernel for prefill, decode and mixed batches that
takes every piece of metadata from device buffers, so it can be captured in a FULL
graph for any batch (support level ALWAYS). ``TorchAttention`` gathers each request's
KV and runs SDPA per request: the CPU path and the reference; it reads host-side lengths,
so it is never captured (support level NEVER).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from ostinato.mathutil import ceil_div
from ostinato.resolution import AttentionGraphSupport


@dataclass
class AttentionMetadata:
    """What attention needs for one step. Device tensors are views of the runner's
    persistent buffers (fixed addresses); host lists are for the torch backend only.

    Per token: ``positions`` (absolute; -1 marks a padding row, which attends to nothing
    and whose output is zero), ``token_req`` (row of ``block_tables``), ``slot_mapping``
    (flat cache slot its K/V is written to; padding rows write to the null block).
    """

    positions: torch.Tensor
    token_req: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)


class AttentionBackend(Protocol):
    """Attention over the paged cache for one step, written into ``out`` (``q``'s shape);
    ``graph_support`` says what can be captured."""

    graph_support: AttentionGraphSupport

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None: ...

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Stores the step's keys and values at their slots (before ``__call__``)."""


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores this step's keys and values (``[n, kv_heads, head_dim]``) at their slots."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TorchAttention:
    """Per-request SDPA over KV gathered from the paged cache (host-side lengths)."""

    graph_support = AttentionGraphSupport.NEVER
    write_kv = staticmethod(write_kv)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        out.zero_()  # padding rows, and rows of no request, output zeros
        block_size = k_cache.shape[1]
        heads, kv_heads = q.shape[1], k_cache.shape[2]
        tables = meta.block_tables.tolist()
        start = 0
        for r, (qlen, slen) in enumerate(zip(meta.query_lens, meta.seq_lens, strict=True)):
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
    ``fused_kv_write``: store K and V in one Triton kernel instead of two ``index_copy_``
    (off until measured on a GPU)."""

    graph_support = AttentionGraphSupport.ALWAYS

    def __init__(self, fused_kv_write: bool = False) -> None:
        self.fused_kv_write = fused_kv_write
        if fused_kv_write:
            from ostinato.engine.triton_attention import write_kv_fused

            self.write_kv = write_kv_fused
        else:
            self.write_kv = write_kv

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        from ostinato.engine.triton_attention import paged_attention

        paged_attention(
            q, k_cache, v_cache, meta.positions, meta.token_req, meta.block_tables, scale, out=out
        )


def default_backend(device: torch.device) -> AttentionBackend:
    """Triton on CUDA when Triton is installed, else the torch backend."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return TorchAttention()
        return TritonAttention()
    return TorchAttention()
