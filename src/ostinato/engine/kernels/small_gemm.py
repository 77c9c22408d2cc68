"""A Triton GEMM for projections of at most 16 rows (decode), with split-K, and the
fusions a decoder layer needs around it.

``out[M, N] = x[M, K] @ w[N, K]^T (+ bias)``: a program per column tile and ``1/SPLIT_K``
of K, so even a narrow projection spreads its weight read over the GPU. With
``SPLIT_K > 1`` each program stores its float32 partial tile, bumps a counter per column
tile, and the program that arrives last sums the partials, runs the epilogue and resets
the counter to zero: the reduction needs no second kernel (cuBLAS's split-K launches one)
and the counters are zero again after every call, so a captured graph replays on them.

Each program accumulates one or two tiles of ``BLOCK_N`` columns: the second starts
``OFF2`` weight rows after the first. What the last program does with them is the
*epilogue*:

- ``PLAIN``: one tile (plus the bias), stored.
- ``SWIGLU``: ``w`` is ``[2N, K]`` (gate rows, then up rows; ``OFF2 = N``) and the
  program writes ``silu(gate) * up`` (both rounded to the output dtype first, then the
  product in float32 rounded once, as the unfused GEMM-then-Inductor-kernel does).
- ``ROPE_KV``: ``w`` is a QKV projection and each program owns one head: its two
  halves are the two tiles (``OFF2 = head_dim / 2``). Query heads are stored to the
  output (unrotated; the attention kernel rotates them as it loads them), key heads are
  rotated (rotate-half RoPE, float32, rounded once) and stored with the value heads at
  their cache slots, as ``paged_attention.write_kv_fused`` stores them. With
  ``QK_NORM`` (Qwen3) each query and key head is RMS-normed first.

``NORM`` (a prologue): the rows ``x`` are first ``rms_norm(x (+ residual)) * norm_weight``
with transformers' arithmetic (the sum rounded to the input dtype, the row in float32,
``h * rsqrt(mean(h^2) + eps)`` rounded, times the weight, rounded): every program sums its
rows' squares over the whole row before its K loop (the rows are a few KB, read from L2),
and normalises each tile as it loads it. With ``ADD`` the program of tile 0, split 0
also stores the sum (the new residual). (Applying ``1 / rms`` to the finished sums
instead, with the squares summed in the K loop, measured up to twice as slow on the H200:
``benchmarks/fused_sweep.py``.)

*Row statistics* hand the norm's sum of squares from one projection to the next, so
the next one's programs need not pass over its rows before their K loop:

- ``STATS_OUT`` (a PLAIN epilogue, with ``ResidualStats``): the program adds the
  residual to its tile (the tile rounded to the output dtype first, the sum rounded
  as torch's add rounds) and stores, per row and ``stats_granule(M)`` columns, the
  float32 sum of squares of that sum to ``stats`` (``[MAX_ROWS, stats_columns(N)]``,
  its ``M`` rows of ``stats_columns(N, M)`` entries one after the other, fixed by N
  whatever the tile width). With ``ADD_OUT`` the stored output is the sum itself.
- ``STATS_IN`` (with ``NORM``): ``rstd`` comes from those sums (one small load) and
  the prologue's pass is skipped; with ``ADD`` the programs of column tile 0 store the
  residual sum from their K loops instead.

The squares are summed in another order than the prologue's, so ``rstd`` may differ
from it in its last float32 bits.

With ``USE_PDL`` (programmatic dependent launch) a program starts pulling the first
``PREFETCH_K`` (``LaunchRules.prefetch_k``) columns of its weight rows into L2 *before*
waiting for the previous kernel: weights do not depend on it, so their read overlaps
its tail.

``RESIDENT`` (at most ``LaunchRules.resident_max_rows`` rows, ``GemmConfig.resident``): a program's
``BLOCK_N`` weight rows (per tile) over the whole of K (``BLOCK_K``, K padded to a power
of two) and the norm weight are loaded into registers before the wait, the next kernel
may launch before it, and after it the program loads only its rows of ``x`` and sums
the products across the tile (CUDA cores): no K loop, no split-K. A ROPE_KV head is then
``SUB`` programs, each with ``BLOCK_N`` columns of both halves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.gemm_launch import (  # noqa: F401  (the GEMM's launch shapes)
    CONFIGS,
    MAX_ROWS,
    PLAIN,
    ROPE_KV,
    SWIGLU,
    GemmConfig,
    counters_needed,
    fits,
    k_per_split,
    rope_head_dim,
    stats_columns,
    stats_granule,
)
from ostinato.engine.kernels.launch import TRIGGER_THEN_WAIT, launch, pdl_arg, pdl_for
from ostinato.engine.kernels.launch_rules import LINE, rules
from ostinato.engine.kernels.lora_segment import (
    LoraSegment,
    lora_first_b,
    lora_segment,
    lora_shrunk,
    lora_slots,
    segment_args,
)
from ostinato.engine.kernels.pdl import pdl_enter

NORM_K = 1024  # row columns per step of the norm prologue's sum of squares


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _rows(x_ptr, r_ptr, rm, ks, stride_xm, stride_rm, mask, ADD: tl.constexpr):
    """Rows ``x`` (plus ``residual``, rounded to x's dtype as torch's add rounds) at
    columns ``ks``."""
    x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0)
    if ADD:
        r = tl.load(r_ptr + rm[:, None] * stride_rm + ks[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def _row_rstd(
    x_ptr, r_ptr, total_ptr, M, K, stride_xm, stride_rm, stride_tm, eps, writer,
    ADD: tl.constexpr, BLOCK_M: tl.constexpr, NORM_K: tl.constexpr,
):  # fmt: skip
    """``rsqrt(mean(h^2) + eps)`` of each row ``h = x (+ residual)`` over all K columns;
    with ``ADD`` and ``writer``, ``h`` is stored to ``total`` on the way."""
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, NORM_K)
    ss = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, K, NORM_K):
        ks = k0 + rk
        mask = (rm[:, None] < M) & (ks[None, :] < K)
        h = _rows(x_ptr, r_ptr, rm, ks, stride_xm, stride_rm, mask, ADD)
        if ADD:
            if writer:
                tl.store(total_ptr + rm[:, None] * stride_tm + ks[None, :], h, mask=mask)
        hf = h.to(tl.float32)
        ss += tl.sum(hf * hf, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _stats_rstd(stats_ptr, M, K, STATS_T, eps, BLOCK_M: tl.constexpr, STATS_P2: tl.constexpr):
    """``rsqrt(mean(h^2) + eps)`` of each row from its ``STATS_T`` partial sums."""
    rm = tl.arange(0, BLOCK_M)
    t = tl.arange(0, STATS_P2)
    mask = (rm[:, None] < M) & (t[None, :] < STATS_T)
    ss = tl.load(stats_ptr + rm[:, None] * STATS_T + t[None, :], mask=mask, other=0.0)
    return tl.rsqrt(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def _residual_stats(
    y, r, stats_ptr, rm, col0, rn, M, N, STATS_T, dtype: tl.constexpr, ADD_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GRANULE: tl.constexpr,
):  # fmt: skip
    """Stores the row statistics of ``y + r`` (``r``: the residual tile, loaded) for this
    tile (see ``STATS_OUT``); returns what the tile stores: that sum with ``ADD_OUT``,
    else ``y``."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    h = (y.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype).to(tl.float32)
    h = tl.where(mask, h, 0.0)
    ss = tl.sum(tl.reshape(h * h, (BLOCK_M, BLOCK_N // GRANULE, GRANULE)), axis=2)
    g = col0 // GRANULE + tl.arange(0, BLOCK_N // GRANULE)
    tl.store(stats_ptr + rm[:, None] * STATS_T + g[None, :], ss, mask=g[None, :] < STATS_T)
    return h if ADD_OUT else y


@triton.jit
def _head_norm(a, b, rstd_eps, w_ptr, HALF: tl.constexpr, dtype: tl.constexpr):
    """Both halves of each row's head RMS-normed (``QK_NORM``), in the norm's arithmetic."""
    ss = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)
    rstd = tl.rsqrt(ss / (2 * HALF) + rstd_eps)[:, None]
    c = tl.arange(0, HALF)
    wa = tl.load(w_ptr + c).to(tl.float32)[None, :]
    wb = tl.load(w_ptr + HALF + c).to(tl.float32)[None, :]
    a = (wa * (a * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    b = (wb * (b * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return a, b


@triton.jit
def _rope_inputs(
    rm, M, head, c0, cos_ptr, sin_ptr, stride_rt, slot_ptr, Q_HEADS, KV_HEADS,
    HALF: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    """What ``_rope_kv_epilogue`` reads besides the projection: each row's cos and sin
    at the program's columns ``c0 .. c0 + WIDTH`` of each half head (for a key head;
    zeros for others, which load nothing) and its cache slot (for key and value heads).
    A kernel loads them before its K loop, so that their round trip overlaps the loop
    rather than lengthening the kernel's tail."""
    c = c0 + tl.arange(0, WIDTH)
    # per-row masks of the program's head kind (a uniform bound: M where it applies, 0);
    # ``c < HALF`` only broadcasts the key mask to the tile's shape
    key_rows = tl.where((head >= Q_HEADS) & (head < Q_HEADS + KV_HEADS), M, 0)
    kv_rows = tl.where(head >= Q_HEADS, M, 0)
    key = (rm[:, None] < key_rows) & (c[None, :] < HALF)
    r = rm[:, None] * stride_rt + c[None, :]
    ca = tl.load(cos_ptr + r, mask=key, other=0.0)
    cb = tl.load(cos_ptr + r + HALF, mask=key, other=0.0)
    sa = tl.load(sin_ptr + r, mask=key, other=0.0)
    sb = tl.load(sin_ptr + r + HALF, mask=key, other=0.0)
    slot = tl.load(slot_ptr + rm, mask=rm < kv_rows, other=0)
    return ca, cb, sa, sb, slot


@triton.jit
def _rope_kv_epilogue(
    a, b, rm, M, head, c0, out_ptr, stride_om, ca, cb, sa, sb, slot, kc_ptr, vc_ptr,
    stride_cs, stride_ch, qn_ptr, kn_ptr, eps, Q_HEADS, KV_HEADS, QK_NORM: tl.constexpr,
    HALF: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    """Stores columns ``c0 .. c0 + WIDTH`` of each half of one head of a QKV
    projection's rows (see ``ROPE_KV``; ``a``, ``b`` the two halves' tiles), with the
    cos, sin and slots ``_rope_inputs`` loaded. ``QK_NORM`` needs the whole head
    (``WIDTH == HALF``)."""
    dtype = out_ptr.dtype.element_ty
    c = c0 + tl.arange(0, WIDTH)
    rows = rm[:, None] < M
    if head < Q_HEADS:
        if QK_NORM:
            tl.static_assert(WIDTH == HALF, "QK_NORM needs a program per whole head")
            a, b = _head_norm(a, b, eps, qn_ptr, HALF, dtype)
        q = out_ptr + rm[:, None] * stride_om + head * 2 * HALF + c[None, :]
        tl.store(q, a.to(dtype), mask=rows)
        tl.store(q + HALF, b.to(dtype), mask=rows)
    else:
        at = slot.to(tl.int64)[:, None] * stride_cs + c[None, :]
        if head < Q_HEADS + KV_HEADS:
            if QK_NORM:
                tl.static_assert(WIDTH == HALF, "QK_NORM needs a program per whole head")
                a, b = _head_norm(a, b, eps, kn_ptr, HALF, dtype)
            # rotate-half: [a, b] * cos + [-b, a] * sin, float32, rounded once
            ra = a * ca.to(tl.float32) + (-b) * sa.to(tl.float32)
            rb = b * cb.to(tl.float32) + a * sb.to(tl.float32)
            k = kc_ptr + at + (head - Q_HEADS) * stride_ch
            tl.store(k, ra.to(kc_ptr.dtype.element_ty), mask=rows)
            tl.store(k + HALF, rb.to(kc_ptr.dtype.element_ty), mask=rows)
        else:
            v = vc_ptr + at + (head - Q_HEADS - KV_HEADS) * stride_ch
            tl.store(v, a.to(vc_ptr.dtype.element_ty), mask=rows)
            tl.store(v + HALF, b.to(vc_ptr.dtype.element_ty), mask=rows)


@triton.jit
def _x_tile(
    x_ptr, r_ptr, total_ptr, nw, rstd, rm, ks, mask, stride_xm, stride_rm, stride_tm, writer,
    NORM: tl.constexpr, ADD: tl.constexpr, STORE_TOTAL: tl.constexpr,
):  # fmt: skip
    """The GEMM's rows at columns ``ks``: ``x``, or with ``NORM`` ``x (+ residual)`` normed
    by ``rstd`` and the norm weight ``nw`` (loaded at ``ks``), each step rounded as the
    unfused norm rounds; with ``STORE_TOTAL`` a ``writer`` stores the rows' sum
    ``x + residual`` to ``total``."""
    dtype = x_ptr.dtype.element_ty
    if NORM:
        h = _rows(x_ptr, r_ptr, rm, ks, stride_xm, stride_rm, mask, ADD)
        if STORE_TOTAL:
            if writer:
                tl.store(total_ptr + rm[:, None] * stride_tm + ks[None, :], h, mask=mask)
        y = (h.to(tl.float32) * rstd[:, None]).to(dtype)
        x = (nw.to(tl.float32)[None, :] * y.to(tl.float32)).to(dtype)
    else:
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0)
    return x


@triton.jit
def _dot_tile(
    x_ptr, r_ptr, total_ptr, nw_ptr, w_ptr, rstd, rn, k_lo, k_hi, K_PER, M, N, stride_xm,
    stride_rm, stride_tm, stride_wn, OFF2, writer, NORM: tl.constexpr, ADD: tl.constexpr,
    STORE_TOTAL: tl.constexpr, TWO: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Float32 ``rows @ W[rn].T`` over columns ``k_lo..k_hi`` (``K_PER`` of them, in whole
    BLOCK_K tiles) of rows ``0..M`` (``_x_tile``), and with ``TWO`` the same of
    ``W[rn + OFF2]``."""
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K_PER, BLOCK_K):
        ks = k0 + k_lo + rk
        x_mask = (rm[:, None] < M) & (ks[None, :] < k_hi)
        nw = ks
        if NORM:
            nw = tl.load(nw_ptr + ks, mask=ks < k_hi, other=0.0)
        x = _x_tile(
            x_ptr, r_ptr, total_ptr, nw, rstd, rm, ks, x_mask, stride_xm, stride_rm,
            stride_tm, writer, NORM, ADD, STORE_TOTAL,
        )  # fmt: skip
        w_mask = (rn[None, :] < N) & (ks[:, None] < k_hi)
        w_ptrs = w_ptr + rn[None, :] * stride_wn + ks[:, None]
        acc = tl.dot(x, tl.load(w_ptrs, mask=w_mask, other=0.0), acc)
        if TWO:
            acc2 = tl.dot(x, tl.load(w_ptrs + OFF2 * stride_wn, mask=w_mask, other=0.0), acc2)
    return acc, acc2


@triton.jit
def _resident_weights(
    w_ptr, nw_ptr, rn, N, K, OFF2, stride_wn, NORM: tl.constexpr, TWO: tl.constexpr,
    K_P2: tl.constexpr,
):  # fmt: skip
    """A ``RESIDENT`` program's weight rows ``rn`` (and ``rn + OFF2`` with ``TWO``) over
    the whole of K, and the norm weight: loaded before the PDL wait, as none depends on
    the previous kernel."""
    rk = tl.arange(0, K_P2)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    w = tl.load(ptrs, mask=mask, other=0.0)
    w2 = w
    if TWO:
        w2 = tl.load(ptrs + OFF2 * stride_wn, mask=mask, other=0.0)
    nw = rk
    if NORM:
        nw = tl.load(nw_ptr + rk, mask=rk < K, other=0.0)
    return w, w2, nw


@triton.jit
def _resident_tile(
    x_ptr, r_ptr, total_ptr, w, w2, nw, rstd, M, K, stride_xm, stride_rm, stride_tm,
    writer, NORM: tl.constexpr, ADD: tl.constexpr, STORE_TOTAL: tl.constexpr,
    TWO: tl.constexpr, BLOCK_M: tl.constexpr, K_P2: tl.constexpr,
):  # fmt: skip
    """Float32 ``rows @ w.T`` (and ``@ w2.T`` with ``TWO``) of the weight tiles a
    ``RESIDENT`` program holds, over the whole of K: products summed across the tile
    (CUDA cores; ``tl.dot`` would pad the rows to 16)."""
    rm = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, K_P2)
    mask = (rm[:, None] < M) & (ks[None, :] < K)
    x = _x_tile(
        x_ptr, r_ptr, total_ptr, nw, rstd, rm, ks, mask, stride_xm, stride_rm, stride_tm,
        writer, NORM, ADD, STORE_TOTAL,
    ).to(tl.float32)[:, None, :]  # fmt: skip
    acc = tl.sum(x * w.to(tl.float32)[None, :, :], axis=2)
    acc2 = acc
    if TWO:
        acc2 = tl.sum(x * w2.to(tl.float32)[None, :, :], axis=2)
    return acc, acc2


@triton.jit
def _epilogue_inputs(
    b_ptr, r_ptr, cos_ptr, sin_ptr, slot_ptr, rm, rn, M, N, OFF2, stride_rm, stride_rt,
    head, c0, Q_HEADS, KV_HEADS, HAS_BIAS: tl.constexpr, TWO: tl.constexpr,
    EPILOGUE: tl.constexpr, STATS_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """What the epilogue reads besides the sums, none of which depends on the K loop:
    (bias, second tile's bias, the residual tile of ``STATS_OUT``, RoPE's cos and sin
    halves and cache slots); zeros where unused. A kernel loads them before its K loop:
    after it (or after the split-K reduction) they would add a dependent round trip to
    the kernel's tail."""
    zeros = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    bias = tl.zeros((BLOCK_N,), tl.float32)
    bias2 = bias
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        if TWO:
            bias2 = tl.load(b_ptr + OFF2 + rn, mask=rn < N, other=0.0).to(tl.float32)
    r = zeros
    if STATS_OUT:
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        r = tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0)
    ca, cb, sa, sb = zeros, zeros, zeros, zeros
    slot = tl.zeros((BLOCK_M,), tl.int32)
    if EPILOGUE == 2:
        ca, cb, sa, sb, slot = _rope_inputs(
            rm, M, head, c0, cos_ptr, sin_ptr, stride_rt, slot_ptr, Q_HEADS, KV_HEADS, HALF,
            BLOCK_N,
        )  # fmt: skip
    return bias, bias2, r, ca, cb, sa, sb, slot


@triton.jit
def _gemm_kernel(
    x_ptr, r_ptr, total_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr,
    cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, qn_ptr, kn_ptr, stats_ptr,
    ls_ptr, lb_ptr, lslot_ptr,
    M, N, K, stride_xm, stride_rm, stride_tm, stride_wn, stride_om,
    N_PAD, K_PER, TILE_STRIDE, OFF2, eps, stride_rt, stride_cs, stride_ch, Q_HEADS, KV_HEADS,
    STATS_T, stride_ls, stride_lb, NORM: tl.constexpr, ADD: tl.constexpr, STATS_IN: tl.constexpr,
    STATS_OUT: tl.constexpr, ADD_OUT: tl.constexpr, STATS_P2: tl.constexpr,
    GRANULE: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
    QK_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PREFETCH_K: tl.constexpr, LINE: tl.constexpr, USE_PDL: tl.constexpr,
    RESIDENT: tl.constexpr, SUB: tl.constexpr, HALF: tl.constexpr, LORA_W: tl.constexpr,
    LORA_W_PAD: tl.constexpr, MAX_LORAS: tl.constexpr, LORA_DOT: tl.constexpr,
):  # fmt: skip
    TWO: tl.constexpr = EPILOGUE != 0
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tile = pid_n // SUB  # SUB programs share a TILE_STRIDE (a resident ROPE_KV's head)
    c0 = (pid_n % SUB) * BLOCK_N
    rm = tl.arange(0, BLOCK_M)
    rn = tile * TILE_STRIDE + c0 + tl.arange(0, BLOCK_N)
    k_lo = pid_k * K_PER  # K_PER: K / SPLIT_K in whole BLOCK_K tiles
    k_hi = tl.minimum(K, k_lo + K_PER)
    if LORA_W > 0:  # (before the wait: no kernel of the step writes the slots or B)
        lslots = lora_slots(lslot_ptr, rm, M, pid_k == 0)  # (split 0 adds the expand)
        if LORA_DOT:  # (tensor cores: not the resident launch, whose registers hold its weights)
            lfirst = lora_first_b(
                lb_ptr, lslots, rn, N, OFF2, stride_lb, TWO, LORA_W, LORA_W_PAD, MAX_LORAS
            )
    if RESIDENT:  # the whole weight tile into registers before the wait (BLOCK_K >= K)
        w, w2, nw = _resident_weights(w_ptr, nw_ptr, rn, N, K, OFF2, stride_wn, NORM, TWO, BLOCK_K)
    elif USE_PDL:
        # Before the wait: start this program's weight read (rows and columns clamped
        # into its own range: a short split's lines past it are its neighbour's).
        lines = k_lo + tl.arange(0, PREFETCH_K // LINE) * LINE
        rows = tl.minimum(rn, N - 1)
        pre = w_ptr + rows[:, None] * stride_wn + tl.minimum(lines, k_hi - 1)[None, :]
        _prefetch_l2(pre)
        if TWO:
            _prefetch_l2(pre + OFF2 * stride_wn)
    pdl_enter(USE_PDL)
    writer = pid_n == 0
    if STATS_IN:
        rstd = _stats_rstd(stats_ptr, M, K, STATS_T, eps, BLOCK_M, STATS_P2)
    elif NORM:
        rstd = _row_rstd(
            x_ptr, r_ptr, total_ptr, M, K, stride_xm, stride_rm, stride_tm, eps,
            writer & (pid_k == 0), ADD, BLOCK_M, NORM_K,
        )  # fmt: skip
    else:
        rstd = tl.zeros((BLOCK_M,), tl.float32)
    bias, bias2, r, ca, cb, sa, sb, slot = _epilogue_inputs(
        b_ptr, r_ptr, cos_ptr, sin_ptr, slot_ptr, rm, rn, M, N, OFF2, stride_rm, stride_rt,
        tile, c0, Q_HEADS, KV_HEADS, HAS_BIAS, TWO, EPILOGUE, STATS_OUT, BLOCK_M, BLOCK_N,
        HALF,
    )  # fmt: skip
    if LORA_W > 0:  # the rows' shrinks (the previous kernel's) in flight beside the K loop
        ls = lora_shrunk(ls_ptr, rm, lslots, stride_ls, LORA_W, LORA_W_PAD)
    if RESIDENT:
        acc, acc2 = _resident_tile(
            x_ptr, r_ptr, total_ptr, w, w2, nw, rstd, M, K, stride_xm, stride_rm, stride_tm,
            writer, NORM, ADD, STATS_IN and ADD, TWO, BLOCK_M, BLOCK_K,
        )  # fmt: skip
    else:
        acc, acc2 = _dot_tile(
            x_ptr, r_ptr, total_ptr, nw_ptr, w_ptr, rstd, rn, k_lo, k_hi, K_PER, M, N,
            stride_xm, stride_rm, stride_tm, stride_wn, OFF2, writer, NORM, ADD,
            STATS_IN and ADD, TWO, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
    if LORA_W > 0:  # each row's LoRA expand, once per column tile (split 0's partial)
        if pid_k == 0:
            if not LORA_DOT:
                lfirst = lora_first_b(
                    lb_ptr, lslots, rn, N, OFF2, stride_lb, TWO, LORA_W, LORA_W_PAD, MAX_LORAS
                )
            acc, acc2 = lora_segment(
                acc, acc2, ls, lslots, lfirst, lb_ptr, rn, N, OFF2, stride_lb, TWO, LORA_W,
                LORA_W_PAD, LORA_DOT,
            )  # fmt: skip
    if SPLIT_K > 1:
        # Partials laid out [SPLIT_K, 2, BLOCK_M, N_PAD], every column of a tile; only
        # the M live rows are stored and summed (the rest are never stored out).
        part = rm[:, None] * N_PAD + (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
        mine = part_ptr + pid_k * 2 * BLOCK_M * N_PAD + part
        live = (rm < M)[:, None]
        tl.store(mine, acc, mask=live)
        if TWO:
            tl.store(mine + BLOCK_M * N_PAD, acc2, mask=live)
        # acq_rel: this program's partial is visible before its count, and the last
        # program sees every other partial after reading the count.
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        if last:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in tl.static_range(SPLIT_K):
                theirs = part_ptr + s * 2 * BLOCK_M * N_PAD + part
                acc += tl.load(theirs, mask=live, other=0.0, cache_modifier=".cg")
                if TWO:
                    acc2 += tl.load(
                        theirs + BLOCK_M * N_PAD, mask=live, other=0.0, cache_modifier=".cg"
                    )
            tl.atomic_xchg(count_ptr + pid_n, 0)
    else:
        last = True
    if last:
        wdtype = w_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += bias[None, :]
            acc2 += bias2[None, :]
        if EPILOGUE == 2:
            a = acc.to(wdtype).to(tl.float32)  # the projection's output, as stored unfused
            b = acc2.to(wdtype).to(tl.float32)
            _rope_kv_epilogue(
                a, b, rm, M, tile, c0, out_ptr, stride_om, ca, cb, sa, sb, slot, kc_ptr,
                vc_ptr, stride_cs, stride_ch, qn_ptr, kn_ptr, eps, Q_HEADS, KV_HEADS, QK_NORM,
                HALF, BLOCK_N,
            )  # fmt: skip
        else:
            if EPILOGUE == 1:
                g = acc.to(wdtype).to(tl.float32)
                y = g * tl.sigmoid(g) * acc2.to(wdtype).to(tl.float32)
            else:
                y = acc
            if STATS_OUT:
                y = _residual_stats(
                    y, r, stats_ptr, rm, tile * TILE_STRIDE + c0, rn, M, N, STATS_T, wdtype,
                    ADD_OUT, BLOCK_M, BLOCK_N, GRANULE,
                )  # fmt: skip
            out_mask = (rm[:, None] < M) & (rn[None, :] < N)
            out_offs = rm[:, None] * stride_om + rn[None, :]
            tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class NormPrologue:
    """The RMSNorm in front of a projection: its ``weight`` (``[K]``, the rows' dtype)
    and ``eps``; with ``residual`` (``[M, K]``) the norm is of ``x + residual``, and that
    sum is stored to ``total`` (``[M, K]``, contiguous rows). With ``stats`` (the row
    statistics of the rows normed, as a ``ResidualStats`` epilogue stored them) the
    programs take the norm's sums of squares from there (``STATS_IN``)."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    total: torch.Tensor | None = None
    stats: torch.Tensor | None = None


@dataclass(frozen=True)
class ResidualStats:
    """A plain projection's epilogue for the norm that follows it (``STATS_OUT``): the
    row statistics of ``out + residual`` (``residual`` ``[M, N]``, rows contiguous) into
    ``stats`` (float32 ``[MAX_ROWS, stats_columns(N)]``); with ``add`` the projection
    returns ``out + residual`` itself."""

    residual: torch.Tensor
    stats: torch.Tensor
    add: bool = False


def _check_stats(stats: torch.Tensor, n: int) -> None:
    shape = (MAX_ROWS, stats_columns(n))
    if stats.shape != shape or stats.dtype != torch.float32 or not stats.is_contiguous():
        raise ValueError(
            f"small_gemm: row statistics must be float32 {shape}, contiguous; got "
            f"{stats.dtype} {tuple(stats.shape)}"
        )


@dataclass(frozen=True)
class RopeKV:
    """Where a QKV projection's heads go (``ROPE_KV``): ``cos``, ``sin`` ``[M, 1, d]`` for
    the keys, the layer's caches ``[blocks, block_size, kv_heads, d]``, each row's flat
    cache slot, the head counts, and the Qwen3 per-head norm weights (``[d]``) with
    their ``eps``."""

    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    q_heads: int
    kv_heads: int
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 0.0


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError(
            f"small_gemm: needs x [<= {MAX_ROWS}, K] with a contiguous last dim and a "
            f"contiguous weight, got x {tuple(x.shape)} strides {x.stride()}"
        )
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"small_gemm: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}"
        )


def _norm_args(x: torch.Tensor, norm: NormPrologue | None) -> tuple[torch.Tensor, ...]:
    """``(norm weight, residual, total)`` pointers for the kernel (``x`` where unused)."""
    if norm is None:
        return x, x, x
    m, k = x.shape
    if norm.weight.shape != (k,) or norm.weight.dtype != x.dtype:
        raise ValueError(f"small_gemm: norm weight must be [{k}] {x.dtype}")
    if norm.stats is not None:
        _check_stats(norm.stats, k)
    if norm.residual is None:
        return norm.weight, x, x
    for name, t in (("residual", norm.residual), ("total", norm.total)):
        if t is None or t.shape != x.shape or t.dtype != x.dtype or t.stride(-1) != 1:
            raise ValueError(
                f"small_gemm: {name} must be {tuple(x.shape)} {x.dtype}, rows contiguous"
            )
    return norm.weight, norm.residual, norm.total


def _rope_args(
    x: torch.Tensor, rope: RopeKV | None, eps: float
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], float]:
    """The ``ROPE_KV`` arguments of ``_gemm_kernel`` (``x`` and zeros where unused):
    (cos, sin, slots, k cache, v cache, q norm, k norm), (cos row stride, cache slot and
    head strides, query and KV heads), and the eps (the head norms' where they run; the
    row norm's is the same config value)."""
    if rope is None:
        return (x,) * 7, (0,) * 5, eps
    kc = rope.k_cache.view(-1, rope.kv_heads, rope.k_cache.shape[-1])
    vc = rope.v_cache.view(-1, rope.kv_heads, rope.v_cache.shape[-1])
    qn = rope.q_norm if rope.q_norm is not None else x
    kn = rope.k_norm if rope.k_norm is not None else x
    tensors = (rope.cos, rope.sin, rope.slot_mapping, kc, vc, qn, kn)
    ints = (rope.cos.stride(0), kc.stride(0), kc.stride(1), rope.q_heads, rope.kv_heads)
    return tensors, ints, rope.eps


def _stats_args(
    x: torch.Tensor, n: int, norm: NormPrologue | None, after: ResidualStats | None
) -> tuple[torch.Tensor, int]:
    """The row statistics a launch reads or writes (``x`` where none) and their columns."""
    if norm is not None and norm.stats is not None:
        if after is not None:
            raise ValueError("small_gemm: row statistics read and written in one launch")
        return norm.stats, stats_columns(x.shape[1], x.shape[0])
    if after is None:
        return x, 1
    _check_stats(after.stats, n)
    r = after.residual
    if r.shape != (x.shape[0], n) or r.dtype != x.dtype or r.stride(-1) != 1:
        raise ValueError(
            f"small_gemm: the residual must be {(x.shape[0], n)} {x.dtype}, rows "
            f"contiguous; got {r.dtype} {tuple(r.shape)} strides {r.stride()}"
        )
    return after.stats, stats_columns(n, x.shape[0])


def _partials(
    counters: torch.Tensor, tiles: int, split_k: int, n_pad: int, out: torch.Tensor
) -> torch.Tensor:
    """The split-K partials ``[split_k, 2, MAX_ROWS, n_pad]`` (``out`` unsplit), after
    checking there is a counter per column tile."""
    if split_k == 1:
        return out
    if counters.numel() < tiles:
        raise ValueError(f"small_gemm: {counters.numel()} counters for {tiles} tiles")
    return torch.empty((split_k, 2, MAX_ROWS, n_pad), dtype=torch.float32, device=out.device)


def _programs(
    config: GemmConfig, m: int, k: int, n: int, epilogue: int, tile_stride: int, off2: int
) -> tuple[int, int]:
    """(programs per column tile, column programs) of a launch over ``cdiv(n,
    tile_stride)`` column tiles: one per tile, or for a resident ``config`` one per
    ``block_n`` columns of the tile (of each half, for ROPE_KV's half heads), after
    checking that ``config`` takes ``m`` rows over ``k`` columns."""
    if not fits(config, m, k, 1 if epilogue == PLAIN else 2):
        raise ValueError(f"small_gemm: {config} does not take {m} rows over K = {k}")
    sub = 1
    if config.resident or config.smem:
        sub = (off2 if epilogue == ROPE_KV else tile_stride) // config.block_n
    return sub, triton.cdiv(n, tile_stride) * sub


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    out: torch.Tensor,
    *,
    epilogue: int,
    n: int,
    config: GemmConfig,
    tile_stride: int,
    off2: int,
    norm: NormPrologue | None,
    rope: RopeKV | None,
    pdl: bool,
    after: ResidualStats | None = None,
    lora: LoraSegment | None = None,
) -> None:
    """One launch of ``_gemm_kernel`` over ``cdiv(n, tile_stride)`` column tiles (a
    resident ``config`` splits each into ``block_n``-column programs), with ``lora``'s
    expand added before the epilogue (not the shared-memory launch's)."""
    # Over 60 lines: the kernel's one launch, its arguments and constants in one call read
    # beside the kernel's signature; split, the same values would pass a second signature.
    m, k = x.shape
    if lora is not None and config.smem:
        raise ValueError(f"small_gemm: {config} takes no LoRA segment; use a K-loop config")
    pdl = pdl_for(pdl, m)  # (the launch rules, and a step measured faster without it)
    segment, segment_constants = segment_args(lora, x, weight.shape[0], config.resident)
    block_n, split_k = config.block_n, config.split_k
    sub, tiles = _programs(config, m, k, n, epilogue, tile_stride, off2)
    n_pad = tiles * block_n
    part = _partials(counters, tiles, split_k, n_pad, out)
    tensors, ints, eps = _rope_args(x, rope, norm.eps if norm is not None else 0.0)
    if config.smem:  # no split-K, no head norms (``rope_config``): the Gluon kernel
        grid = (tiles, sub, tile_stride, off2)
        rope_args = (tensors, ints)
        _launch_smem(x, weight, bias, out, config, epilogue, grid, norm, after, rope_args, pdl)
        return
    nw, res, total = _norm_args(x, norm)
    stats, stats_t = _stats_args(x, n, norm, after)
    if after is not None:
        res = after.residual
    # A resident program lets the next kernel launch before its own wait: the next
    # one's weights then load while this one waits (benchmarks.resident_gemv).
    use_pdl = TRIGGER_THEN_WAIT if pdl and config.resident else pdl_arg(pdl)
    launch(
        _gemm_kernel,
        (tiles, split_k),
        x, res, total, nw, weight, bias if bias is not None else weight, out, part,
        counters, *tensors, stats, *segment[:3],
        m, n, k, x.stride(0), res.stride(0), total.stride(0), weight.stride(0), out.stride(0),
        n_pad, k_per_split(k, split_k, config.block_k), tile_stride, off2, eps, *ints,
        stats_t, *segment[3:],
        NORM=norm is not None,
        ADD=norm is not None and norm.residual is not None,
        STATS_IN=norm is not None and norm.stats is not None,
        STATS_OUT=after is not None,
        ADD_OUT=after is not None and after.add,
        STATS_P2=triton.next_power_of_2(stats_t),
        GRANULE=stats_granule(m),
        HAS_BIAS=bias is not None,
        EPILOGUE=epilogue,
        QK_NORM=rope is not None and rope.q_norm is not None,
        BLOCK_M=triton.next_power_of_2(m) if config.resident else MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=triton.next_power_of_2(k) if config.resident else config.block_k,
        NORM_K=min(NORM_K, triton.next_power_of_2(k)),
        SPLIT_K=split_k,
        PREFETCH_K=rules().prefetch_k,
        LINE=LINE,
        USE_PDL=use_pdl,
        RESIDENT=config.resident,
        SUB=sub,
        HALF=off2 if epilogue == ROPE_KV else block_n,
        **segment_constants,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl,
    )  # fmt: skip


def _launch_smem(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: GemmConfig,
    epilogue: int,
    grid: tuple[int, int, int, int],
    norm: NormPrologue | None,
    after: ResidualStats | None,
    rope_args: tuple[tuple[torch.Tensor, ...], tuple[int, ...]],
    pdl: bool,
) -> None:
    """A projection by the shared-memory launch (``smem_gemm``) over ``grid`` (programs,
    programs per tile, tile stride, second tile's offset) with ``_rope_args``'s tensors
    and integers, after the same checks of the norm and the row statistics as
    ``_launch``'s."""
    from ostinato.engine.kernels.smem_gemm import launch_smem

    nw, res, total = _norm_args(x, norm)
    stats, stats_t = _stats_args(x, weight.shape[0], norm, after)
    launch_smem(
        x, weight, bias, out, config, epilogue=epilogue, grid=grid,
        norm=(nw, res, total, norm.eps) if norm is not None else None,
        stats=(
            stats, stats_t, norm is not None and norm.stats is not None,
            norm is not None and norm.residual is not None,
        ),
        residual=after.residual if after is not None else None,
        add_out=after is not None and after.add, rope=rope_args, pdl=pdl,
    )  # fmt: skip


def small_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    config: GemmConfig,
    swiglu: bool = False,
    pdl: bool = False,
    norm: NormPrologue | None = None,
    after: ResidualStats | None = None,
    lora: LoraSegment | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a 2-D ``x`` of at most ``MAX_ROWS`` rows with a
    contiguous last dimension; with ``swiglu`` (no bias), ``silu(g) * u`` of its two
    halves ``[g | u]``; with ``norm``, of the normed rows (``NormPrologue``); with
    ``after`` (not with ``swiglu``), the row statistics for the next norm, and with its
    ``add`` the projection plus its residual (``ResidualStats``); with ``lora``, each
    row's LoRA expand added to the projection first (``LoraSegment``; not ``config.smem``).
    ``counters``: int32 zeros, at least ``counters_needed(N)``, not shared with a call
    that may run at the same time; zero again when the kernel ends."""
    _check_rows(x, weight)
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if swiglu and (bias is not None or weight.shape[0] % 2 or after is not None):
        raise ValueError(
            f"small_gemm: swiglu needs an even row count, no bias and no residual "
            f"statistics, got weight {tuple(weight.shape)}"
        )
    out = torch.empty((x.shape[0], n), dtype=weight.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    _launch(
        x, weight, bias, counters, out,
        epilogue=SWIGLU if swiglu else PLAIN, n=n, config=config,
        tile_stride=config.block_n, off2=n if swiglu else 0, norm=norm, rope=None, pdl=pdl,
        after=after, lora=lora,
    )  # fmt: skip
    return out


def qkv_rope_kv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    config: GemmConfig,
    rope: RopeKV,
    norm: NormPrologue | None = None,
    pdl: bool = False,
    out: torch.Tensor | None = None,
    lora: LoraSegment | None = None,
) -> torch.Tensor:
    """A QKV projection of at most ``MAX_ROWS`` rows in one kernel: returns the query
    heads ``[M, q_heads * d]`` (QK-normed, unrotated; into ``out`` when given, any row
    stride) and stores the rotated keys and the values at ``rope.slot_mapping`` in the
    caches (see ``ROPE_KV``); with ``norm``, of the normed rows. ``d`` a power of two
    >= 32; one counter per head; ``config``'s column tile is the half head (a resident
    config's programs take ``block_n`` columns of each half; not with the head norms).
    ``lora``: each row's LoRA expand added to the projection before the heads are
    normed and rotated (``LoraSegment``; not ``config.smem``)."""
    _check_rows(x, weight)
    d = rope.k_cache.shape[-1]
    heads = rope.q_heads + 2 * rope.kv_heads
    if not rope_head_dim(d) or weight.shape[0] != heads * d:
        raise ValueError(
            f"qkv_rope_kv: weight {tuple(weight.shape)} is not {heads} heads of a "
            f"power-of-two head dim >= 32 (cache head dim {d})"
        )
    shape = (x.shape[0], rope.q_heads * d)
    if out is None:
        out = torch.empty(shape, dtype=weight.dtype, device=x.device)
    elif out.shape != shape or out.stride(-1) != 1:
        raise ValueError(f"qkv_rope_kv: out must be {shape} with a contiguous last dim")
    if (config.resident or config.smem) and rope.q_norm is not None:
        raise ValueError(
            "qkv_rope_kv: the head norms need a program per head, not resident or smem"
        )
    if x.shape[0] == 0:
        return out
    _launch(
        x, weight, bias, counters, out,
        epilogue=ROPE_KV, n=weight.shape[0],
        config=config if config.resident or config.smem else replace(config, block_n=d // 2),
        tile_stride=d, off2=d // 2, norm=norm, rope=rope, pdl=pdl, lora=lora,
    )  # fmt: skip
    return out
