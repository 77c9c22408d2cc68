"""A paged attention kernel for any mix of prefill and decode tokens, graph-safe.

One program per (query token, KV head) handles the query heads of that KV head's group:
it reads the token's position and request from device memory and walks that request's
block table over keys ``0..position`` only (the live KV), with an online softmax in
float32. No host-side lengths are used, so a captured graph replays on new metadata.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    pos_ptr,
    req_ptr,
    tables_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_tr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tok = tl.program_id(0)
    kvh = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int32)
    req = tl.load(req_ptr + tok).to(tl.int32)
    ctx = pos + 1  # padding rows have position -1: no keys

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    # Each iteration takes BLOCK_N keys spanning several pages: fewer, wider loads in flight.
    for start in range(0, ctx, BLOCK_N):
        keys = start + n_off
        live = keys < ctx
        page = tl.load(tables_ptr + req * stride_tr + keys // BLOCK_SIZE, mask=live, other=0)
        kv_off = (
            page.to(tl.int64)[:, None] * stride_kb
            + (keys % BLOCK_SIZE)[:, None] * stride_ks
            + kvh * stride_kh
            + d[None, :]
        )
        k = tl.load(k_ptr + kv_off, mask=live[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=live[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(
        out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    token_req: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q`` (``[n, heads, d]``) over the paged cache; returns ``[n, heads, d]``.

    Token i attends to keys ``0..positions[i]`` of request ``token_req[i]``; a row with
    position -1 outputs zeros. The cache must already hold this step's keys and values.
    """
    n, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    if n == 0:
        return out
    q = q.contiguous()
    _paged_attention_kernel[(n, kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        positions,
        token_req,
        block_tables,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=64,
        num_warps=4,
    )
    return out
