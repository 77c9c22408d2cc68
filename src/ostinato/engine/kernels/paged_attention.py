"""A paged attention kernel for any mix of prefill and decode tokens, graph-safe.

Each program handles one query token and the query heads of one KV head's group: it reads
the token's position and request from device memory and walks that request's block table
over keys ``0..position`` only (the live KV), with an online softmax in float32. When
tokens x KV heads are too few to fill the GPU (small decode batches), the keys of each
token are split across ``splits`` programs whose partial results a second kernel merges
(flash-decoding). The split count depends only on the token count, never on lengths read
from the host, so a captured graph replays correctly on new metadata.

RoPE can be applied here instead of in the model (``rope``): the attention kernel rotates
each query as it loads it and the K/V write rotates each key as it stores it, both in
float32 and rounded once to the cache's dtype, as the compiled model's rotation kernel
does. That removes a layer's rotation kernels and lets q, k, v stay strided views.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.attention_launch import (
    MAX_SPLITS,
    AttentionLaunch,
    launch_for,
    splits_for,
)
from ostinato.engine.kernels.launch import launch, num_sms, pdl_arg, pdl_for
from ostinato.engine.kernels.launch_rules import rules
from ostinato.engine.kernels.pdl import pdl_enter


@triton.jit
def _rotated(ptr, rows, d, cos_ptr, sin_ptr, HEAD_DIM: tl.constexpr, mask):
    """Rows ``ptr + rows[:, None] + d[None, :]`` rotated rotate-half style by this row
    block's ``cos``/``sin`` (``[HEAD_DIM]`` at ``cos_ptr``, ``sin_ptr``), in float32."""
    half = HEAD_DIM // 2
    x = tl.load(ptr + rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(
        ptr + rows[:, None] + ((d + half) % HEAD_DIM)[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    rot = tl.where(d[None, :] < half, -partner, partner)
    c = tl.load(cos_ptr + d).to(tl.float32)
    s = tl.load(sin_ptr + d).to(tl.float32)
    return x * c[None, :] + rot * s[None, :]


@triton.jit
def _query(
    q_ptr, tok, heads, d, g_mask, cos_ptr, sin_ptr, stride_rt, stride_qt, stride_qh,
    HEAD_DIM: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    """The query rows ``heads`` of token ``tok`` (``[GROUP_PAD, HEAD_DIM]``, q's dtype),
    rotated by the token's cos/sin with ``ROPE``."""
    if ROPE:
        rows = tok * stride_qt + heads * stride_qh
        r = tok * stride_rt
        q = _rotated(q_ptr, rows, d, cos_ptr + r, sin_ptr + r, HEAD_DIM, g_mask[:, None])
        return q.to(q_ptr.dtype.element_ty)
    return tl.load(
        q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )


@triton.jit
def _kv_offsets(
    tables_ptr, req, kvh, keys, live, stride_kb, stride_ks, stride_kh, stride_tr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Offsets ``[len(keys), HEAD_DIM]`` into the K and V caches of keys ``keys`` (those
    ``live``) of request row ``req``, KV head ``kvh``, through its block table."""
    d = tl.arange(0, HEAD_DIM)
    page = tl.load(tables_ptr + req * stride_tr + keys // BLOCK_SIZE, mask=live, other=0)
    return (
        page.to(tl.int64)[:, None] * stride_kb
        + (keys % BLOCK_SIZE)[:, None] * stride_ks
        + kvh * stride_kh
        + d[None, :]
    )


@triton.jit
def _softmax_start(GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The online softmax's state before any key: max -inf, sum and output zero."""
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    return m, tl.zeros([GROUP_PAD], tl.float32), tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)


@triton.jit
def _dot(a, b):
    """``a @ b`` to the operands' own precision. Float32 operands take three tf32
    products (``tf32x3``: each operand split into a tf32 head and its remainder, the
    remainders' product dropped): on the H200 within float32's error of a float64
    reference (2e-7 relative against IEEE's 1.5e-7) and 1.2 to 2.4x faster than IEEE
    products, which run on CUDA cores. Triton's default for float32, a single tf32
    product (10 mantissa bits, 8.5e-4), made a float32 model's greedy tokens hang on the
    tiles and splits of its batch."""
    if a.dtype.is_fp32():
        c = tl.dot(a, b, input_precision="tf32x3")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _softmax_step(q, k, v, live, m, l_sum, acc, scale):
    """The online softmax's running max, sum and unnormalised output after one tile of
    keys ``k`` and values ``v`` (rows not ``live`` ignored; at least one live)."""
    s = _dot(q, tl.trans(k)).to(tl.float32) * scale
    s = tl.where(live[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_sum, acc


@triton.jit
def _attend(
    q, m, l_sum, acc, k_ptr, v_ptr, tables_ptr, req, kvh, lo, hi, scale,
    stride_kb, stride_ks, stride_kh, stride_tr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The online softmax state ``m, l_sum, acc`` carried on over keys ``lo..hi`` of
    request row ``req``'s pages (KV head ``kvh``): the running max, the running sum and
    the unnormalised output, float32."""
    n_off = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        keys = start + n_off
        live = keys < hi
        kv_off = _kv_offsets(
            tables_ptr, req, kvh, keys, live, stride_kb, stride_ks, stride_kh, stride_tr,
            HEAD_DIM, BLOCK_SIZE,
        )  # fmt: skip
        k = tl.load(k_ptr + kv_off, mask=live[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=live[:, None], other=0.0)
        m, l_sum, acc = _softmax_step(q, k, v, live, m, l_sum, acc, scale)
    return m, l_sum, acc


@triton.jit
def _key_range(pos, splits, split, BLOCK_N: tl.constexpr):
    """Keys ``lo..hi`` of split ``split`` of a token at ``pos``, in whole BLOCK_N tiles
    (none for a padding row, at position -1)."""
    ctx = pos + 1
    chunk = tl.cdiv(tl.cdiv(ctx, splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    return lo, tl.minimum(ctx, lo + chunk)


# ``splits`` and ``new_keys`` are runtime arguments and never specialised (Triton would
# otherwise compile separately for 1 and for multiples of 16): one compiled kernel per
# layout, not per split count, which cut a cold start-up's Triton compilations of this
# file from 10 to 4.
@triton.jit(do_not_specialize=["splits", "new_keys"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, pos_ptr, req_ptr, tables_ptr, cos_ptr,
    sin_ptr, scale, stride_rt, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_ot, stride_oh, stride_tr, splits, new_keys,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    ROPE: tl.constexpr, EARLY: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    heads = kvh * GROUP + g
    m, l_sum, acc = _softmax_start(GROUP_PAD, HEAD_DIM)
    if not EARLY:
        pdl_enter(USE_PDL)
    # With EARLY, the step's inputs and the keys of earlier steps are read before the PDL
    # wait (the kernels still running write only this step's keys); only the first tile.
    pos = tl.load(pos_ptr + tok).to(tl.int32)
    req = tl.load(req_ptr + tok).to(tl.int32)
    lo, hi = _key_range(pos, splits, split, BLOCK_N)
    if EARLY:
        keys = lo + tl.arange(0, BLOCK_N)
        live = keys < hi
        kv_off = _kv_offsets(
            tables_ptr, req, kvh, keys, live, stride_kb, stride_ks, stride_kh, stride_tr,
            HEAD_DIM, BLOCK_SIZE,
        )  # fmt: skip
        old = live & (keys <= pos - new_keys)  # written by an earlier step
        k = tl.load(k_ptr + kv_off, mask=old[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=old[:, None], other=0.0)
        pdl_enter(USE_PDL)
        new = live & (keys > pos - new_keys)
        k = tl.load(k_ptr + kv_off, mask=new[:, None], other=k)
        v = tl.load(v_ptr + kv_off, mask=new[:, None], other=v)
    q = _query(
        q_ptr, tok, heads, d, g_mask, cos_ptr, sin_ptr, stride_rt, stride_qt, stride_qh,
        HEAD_DIM, ROPE,
    )  # fmt: skip
    if EARLY:
        if lo < hi:
            m, l_sum, acc = _softmax_step(q, k, v, live, m, l_sum, acc, scale)
        lo = lo + BLOCK_N
    m, l_sum, acc = _attend(
        q, m, l_sum, acc, k_ptr, v_ptr, tables_ptr, req, kvh, lo, hi, scale,
        stride_kb, stride_ks, stride_kh, stride_tr, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
    )  # fmt: skip
    _store(
        out_ptr, m_ptr, l_ptr, m, l_sum, acc, tok, heads, g_mask, split, splits, stride_ot,
        stride_oh, GROUP, HEAD_DIM, SPLIT,
    )  # fmt: skip


@triton.jit
def _store(
    out_ptr, m_ptr, l_ptr, m, l_sum, acc, tok, heads, g_mask, split, splits, stride_ot,
    stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """The group's output rows (unsplit), or its unnormalised float32 partials and their
    running max and sum, laid out [token, head, split, (d)]."""
    d = tl.arange(0, HEAD_DIM)
    if not SPLIT:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(
            out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None],
        )
    else:
        row = (tok * GROUP * tl.num_programs(1) + heads) * splits + split
        tl.store(m_ptr + row, m, mask=g_mask)
        tl.store(l_ptr + row, l_sum, mask=g_mask)
        tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _merged(
    part_ptr, m_ptr, l_ptr, first, splits,
    HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """One head's output ``[HEAD_DIM]`` (float32) from its ``splits`` partials at rows
    ``first..first + splits`` of the partial buffers (loaded with cache modifier
    ``CACHE``: ".cg" where another program of the same launch wrote them)."""
    s = tl.arange(0, MAX_SPLITS)
    live = s < splits
    d = tl.arange(0, HEAD_DIM)
    row = first + s
    m = tl.load(m_ptr + row, mask=live, other=float("-inf"), cache_modifier=CACHE)
    l_sum = tl.load(l_ptr + row, mask=live, other=0.0, cache_modifier=CACHE)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: padding row
    w = tl.exp(m - m_max)
    parts = part_ptr + row[:, None] * HEAD_DIM + d[None, :]
    acc = tl.load(parts, mask=live[:, None], other=0.0, cache_modifier=CACHE)
    total = tl.sum(acc * w[:, None], axis=0)
    norm = tl.sum(l_sum * w, axis=0)
    return total / tl.where(norm > 0, norm, 1.0)


@triton.jit(do_not_specialize=["splits"])
def _merge_splits_kernel(
    part_ptr, m_ptr, l_ptr, out_ptr, stride_ot, stride_oh, splits,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    tok = tl.program_id(0)
    head = tl.program_id(1)
    first = (tok * HEADS + head) * splits
    out = _merged(part_ptr, m_ptr, l_ptr, first, splits, HEAD_DIM, MAX_SPLITS, "")
    d = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def num_splits(num_tokens: int, kv_heads: int, device: torch.device) -> int:
    """Programs per (token, KV head): enough for a few waves over the GPU's SMs
    (``attention_launch.splits_for``)."""
    return splits_for(num_tokens, kv_heads, num_sms(device))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    token_req: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    splits: int | None = None,
    out: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    pdl: bool = False,
    config: AttentionLaunch | None = None,
    new_keys: int = 0,
) -> torch.Tensor:
    """Attention of ``q`` (``[n, heads, d]``, any token and head strides) over the paged
    cache; returns ``[n, heads, d]``, written into ``out`` when given (any strides with a
    contiguous last dimension: no second buffer, no copy).

    Token i attends to keys ``0..positions[i]`` of request ``token_req[i]``; a row with
    position -1 outputs zeros. The cache must already hold this step's keys and values.
    ``splits`` (a power of two) overrides the automatic split of each token's keys.
    ``rope = (cos, sin)`` (``[n, 1, d]`` each): q is unrotated; each query is rotated as
    it is loaded (float32, rounded once to q's dtype). ``pdl``: launch with
    programmatic dependent launch (compute capability 9.0 or newer). ``config``
    overrides the launch configuration (``attention_launch.launch_for``'s). ``new_keys``
    (with ``pdl``; 0: unknown): every key the kernel before may still be writing is within
    ``new_keys - 1`` below its token's position (a step's longest query says it); older
    keys of the first tile are then read before the PDL wait (``LaunchRules.early_keys``)."""
    n, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = _output(q, out)
    if n == 0:
        return out
    if new_keys < 0:
        raise ValueError(f"paged_attention: new_keys must be >= 0 (0: unknown), got {new_keys}")
    pdl = pdl_for(pdl, n)
    if q.stride(-1) != 1:
        q = q.contiguous()
    cos, sin, stride_rt = _rope_args(rope, q, n, head_dim)
    splits = _splits(splits or num_splits(n, kv_heads, q.device))
    early = pdl and new_keys > 0 and rules().early_keys
    config = config or launch_for(splits, n * kv_heads, early, head_dim, k_cache.element_size())
    target, m, l_sum = _split_scratch(out, splits)
    so_t, so_h = (0, 0) if splits > 1 else (out.stride(0), out.stride(1))
    launch(
        _paged_attention_kernel, (n, kv_heads, splits),
        q, k_cache, v_cache, target, m, l_sum, positions, token_req, block_tables, cos, sin,
        scale, stride_rt, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), so_t, so_h, block_tables.stride(0), splits, new_keys,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=config.block_n, SPLIT=splits > 1,
        ROPE=rope is not None, EARLY=early,
        USE_PDL=pdl_arg(pdl), num_warps=config.num_warps, num_stages=config.num_stages,
        launch_pdl=pdl,
    )  # fmt: skip
    if splits > 1:
        _merge_splits(target, m, l_sum, out, pdl)
    return out


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out``, checked, or a new tensor like ``q``."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(
            f"paged_attention: out must be {tuple(q.shape)} with a contiguous last dim"
        )
    return out


def _splits(splits: int) -> int:
    if splits > MAX_SPLITS:
        raise ValueError(f"paged_attention: splits={splits} exceeds MAX_SPLITS={MAX_SPLITS}")
    return splits


def _split_scratch(
    out: torch.Tensor, splits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the attention kernel writes: with one split, ``out`` itself (the running max
    and sum are unused); with several, float32 partial outputs ``[n, heads, splits, d]``
    and their running max and sum ``[n, heads, splits]``, merged afterwards."""
    if splits == 1:
        return out, out, out
    n, heads, head_dim = out.shape
    partial = torch.empty((n, heads, splits, head_dim), dtype=torch.float32, device=out.device)
    m = torch.empty((n, heads, splits), dtype=torch.float32, device=out.device)
    return partial, m, torch.empty_like(m)


def _merge_splits(
    partial: torch.Tensor, m: torch.Tensor, l_sum: torch.Tensor, out: torch.Tensor, pdl: bool
) -> None:
    """Merges the splits' partial outputs into ``out`` (one program per token and head)."""
    n, heads, splits, head_dim = partial.shape
    launch(
        _merge_splits_kernel,
        (n, heads),
        partial,
        m,
        l_sum,
        out,
        out.stride(0),
        out.stride(1),
        splits,
        HEADS=heads,
        HEAD_DIM=head_dim,
        MAX_SPLITS=MAX_SPLITS,
        USE_PDL=pdl_arg(pdl),
        num_warps=4,
        launch_pdl=pdl,
    )


def _rope_args(
    rope: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor, n: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``cos, sin`` and their row stride for a kernel (``x`` as a placeholder without
    rope); checks their shape."""
    if rope is None:
        return x, x, 0
    cos, sin = rope
    if (
        cos.shape[0] != n
        or cos.shape[-1] != head_dim
        or cos.numel() != n * head_dim
        or cos.stride() != sin.stride()
        or cos.shape != sin.shape
        or cos.stride(-1) != 1
        or head_dim % 2
    ):
        raise ValueError(
            f"rope: cos and sin must be [{n}, 1, {head_dim}] with one layout and a "
            f"contiguous last dim (an even head dim), got {tuple(cos.shape)} strides "
            f"{cos.stride()} and {tuple(sin.shape)} strides {sin.stride()}"
        )
    return cos, sin, cos.stride(0)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    stride_rt,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    ROPE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    if ROPE:
        rows = tl.zeros([1], tl.int64) + tok * stride_kt + head * stride_kh
        r = tok * stride_rt
        every = (d < HEAD_DIM)[None, :]
        k = _rotated(k_ptr, rows, d, cos_ptr + r, sin_ptr + r, HEAD_DIM, every)
        k = tl.reshape(k, [HEAD_DIM]).to(kc_ptr.dtype.element_ty)
    else:
        k = tl.load(k_ptr + tok * stride_kt + head * stride_kh + d)
    v = tl.load(v_ptr + tok * stride_vt + head * stride_vh + d)
    tl.store(kc_ptr + slot * stride_cs + head * stride_ch + d, k)
    tl.store(vc_ptr + slot * stride_cs + head * stride_ch + d, v)


def write_kv_fused(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    pdl: bool = False,
) -> None:
    """Stores this step's keys and values (``[n, kv_heads, head_dim]``, any token and head
    strides) at their flat slots in one kernel launch; the same bytes as two
    ``index_copy_`` calls. ``head_dim`` must be a power of two. ``rope = (cos, sin)``:
    the keys are unrotated; each is rotated as it is stored (float32, rounded once to
    the cache's dtype). ``pdl``: launch with programmatic dependent launch."""
    n, kv_heads, head_dim = k.shape
    if n == 0:
        return
    pdl = pdl_for(pdl, n)
    if k.stride(-1) != 1 or v.stride(-1) != 1 or head_dim & (head_dim - 1):
        raise ValueError("write_kv_fused: needs a contiguous, power-of-two head dim")
    kc = k_cache.view(-1, kv_heads, head_dim)
    vc = v_cache.view(-1, kv_heads, head_dim)
    cos, sin, stride_rt = _rope_args(rope, k, n, head_dim)
    launch(
        _write_kv_kernel,
        (n, kv_heads),
        k,
        v,
        kc,
        vc,
        slot_mapping,
        cos,
        sin,
        stride_rt,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc.stride(0),
        kc.stride(1),
        HEAD_DIM=head_dim,
        ROPE=rope is not None,
        USE_PDL=pdl_arg(pdl),
        num_warps=1,
        launch_pdl=pdl,
    )
