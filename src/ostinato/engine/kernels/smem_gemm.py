"""The small GEMM's *shared-memory* launch (``GemmConfig.smem``, 3 to 8 rows), in Gluon,
Triton's lower-level dialect, which can hold a tile in shared memory across the PDL wait.

Each program owns ``BLOCK_N`` weight rows over the whole of K:

- Before the wait it lets the next kernel launch and starts ``cp.async`` copies of its
  weight rows into shared memory as ``[G, BLOCK_N, K / G]``: K cut into a chunk per warp.
  No weight byte depends on the previous kernel, so the read overlaps its tail.
- After the wait it stages the rows of ``x`` the same way (``[G, MP, K / G]``, rows past
  M zero), through registers: as they are, or with ``NORM`` normed first as
  ``small_gemm``'s prologue norms them (its rounding steps; ``rstd`` from the row
  statistics with ``STATS_IN``, else from a pass over the rows; with ``ADD`` program 0
  stores ``x + residual``).
- Each warp multiplies its chunk on tensor cores (``mma.sync``, the weight as the 16-row
  operand, so the rows pad only to 8), the warps' products are summed and the
  epilogue runs, ``small_gemm``'s arithmetic in each:
  - ``PLAIN``: the bias, and with ``STATS_OUT`` the row statistics of the sum with the
    residual (one ``GRANULE`` entry a row, ``BLOCK_N == GRANULE``), storing that sum
    with ``ADD_OUT``;
  - ``SWIGLU``: a second tile ``OFF2`` rows on (the up rows), ``silu(gate) * up``;
  - ``ROPE_KV``: ``SUB`` programs a QKV head (``TILE_STRIDE`` its dims), each with
    ``BLOCK_N`` columns of both halves (the second tile); query heads stored, key heads
    rotated and value heads as they are to their cache slots. Not the head norms
    (``rope_config``), which need a whole head a program.

No K loop after the wait, no split-K. On the H200 (``benchmarks.smem_gemv``, cold
weights, PDL chain) the 1.5 B shape's QKV weight took 4.17 µs at 8 rows against the K
loop's 7.82, its O 3.54 against 5.71, SmolLM2's down 1.84 against 3.73.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from ostinato.engine.kernels import gemm_launch
from ostinato.engine.kernels.gemm_launch import GemmConfig, smem_k_step
from ostinato.engine.kernels.launch import launch

# the epilogues, as a Gluon kernel reads a module's constants
PLAIN = gl.constexpr(gemm_launch.PLAIN)
SWIGLU = gl.constexpr(gemm_launch.SWIGLU)
ROPE_KV = gl.constexpr(gemm_launch.ROPE_KV)


@gluon.jit
def _pdl_trigger_then_wait(USE_PDL: gl.constexpr):
    if USE_PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; griddepcontrol.wait; mov.u32 $0, 0;",
            "=r", [], dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@gluon.jit
def _rows_at(x_ptr, r_ptr, m, cols, M, stride_xm, stride_rm, ADD: gl.constexpr):
    """``x`` (plus the residual, rounded as torch's add rounds) at rows ``m`` (``[1, MP,
    1]``) and columns ``cols`` (``[G, 1, KS]``); zero past M."""
    mask = (m < M) & (cols >= 0)
    h = gl.load(x_ptr + m * stride_xm + cols, mask=mask, other=0.0)
    if ADD:
        r = gl.load(r_ptr + m * stride_rm + cols, mask=mask, other=0.0)
        h = (h.to(gl.float32) + r.to(gl.float32)).to(x_ptr.dtype.element_ty)
    return h


@gluon.jit
def _rstd(
    x_ptr, r_ptr, total_ptr, stats_ptr, m, cols, M, stride_xm, stride_rm, stride_tm,
    STATS_T, eps, writer, K: gl.constexpr, KS: gl.constexpr, KC: gl.constexpr,
    MP: gl.constexpr, ADD: gl.constexpr, STATS_IN: gl.constexpr, STATS_P2: gl.constexpr,
    LAYOUT: gl.constexpr,
):  # fmt: skip
    """Each row's ``rsqrt(mean(h^2) + eps)``, shaped ``[1, MP, 1]``: from its ``STATS_T``
    row statistics, or summed over the rows (``writer`` storing ``h`` to ``total``)."""
    if STATS_IN:
        t = gl.arange(0, STATS_P2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LAYOUT)))
        t = t[None, None, :]
        s = gl.load(stats_ptr + m * STATS_T + t, mask=(m < M) & (t < STATS_T), other=0.0)
        ss = gl.sum(gl.sum(s, axis=2), axis=0)
    else:
        ss = gl.zeros([MP], gl.float32, gl.SliceLayout(0, gl.SliceLayout(2, LAYOUT)))
        for s in gl.static_range(KC // KS):
            h = _rows_at(x_ptr, r_ptr, m, cols + s * KS, M, stride_xm, stride_rm, ADD)
            if ADD:
                if writer:
                    live = (m < M) & (cols >= 0)
                    gl.store(total_ptr + m * stride_tm + cols + s * KS, h, mask=live)
            hf = h.to(gl.float32)
            ss += gl.sum(gl.sum(hf * hf, axis=2), axis=0)
    return gl.rsqrt(ss / K + eps)[None, :, None]


@gluon.jit
def _copy_rows(ws, w_ptr, rows, cols, K: gl.constexpr, KS: gl.constexpr, KC: gl.constexpr):
    """Starts the ``cp.async`` copies of weight rows ``rows`` (``[1, BLOCK_N, 1]``) at
    columns ``cols`` (``[G, 1, KS]``, each warp's chunk) into ``ws``."""
    for s in gl.static_range(KC // KS):
        at = w_ptr + rows * K + cols + s * KS
        cp.async_copy_global_to_shared(ws.slice(s * KS, KS, dim=2), at)


@gluon.jit
def _smem_gemm_kernel(
    x_ptr, r_ptr, total_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, res_ptr, stats_ptr,
    cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr,
    M, N, OFF2, stride_xm, stride_rm, stride_tm, stride_om, stride_qm, STATS_T, eps,
    stride_rt, stride_cs, stride_ch, Q_HEADS, KV_HEADS,
    K: gl.constexpr, BLOCK_N: gl.constexpr, MP: gl.constexpr, G: gl.constexpr,
    KS: gl.constexpr, NORM: gl.constexpr, ADD: gl.constexpr, STATS_IN: gl.constexpr,
    STATS_OUT: gl.constexpr, ADD_OUT: gl.constexpr, HAS_BIAS: gl.constexpr,
    STATS_P2: gl.constexpr, EPILOGUE: gl.constexpr, SUB: gl.constexpr,
    TILE_STRIDE: gl.constexpr, USE_PDL: gl.constexpr,
):  # fmt: skip
    KC: gl.constexpr = K // G
    KCP: gl.constexpr = triton.next_power_of_2(KC)  # a buffer's sides are powers of two
    TWO: gl.constexpr = EPILOGUE != PLAIN
    dtype: gl.constexpr = w_ptr.dtype.element_ty
    tile = gl.program_id(0) // SUB  # SUB programs share a tile (ROPE_KV's head)
    c0 = (gl.program_id(0) % SUB) * BLOCK_N
    n0 = tile * TILE_STRIDE + c0
    copy: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [G, 1, 1], [2, 1, 0])
    shared: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0])
    ws = gl.allocate_shared_memory(dtype, [G, BLOCK_N, KCP], shared)
    ws2 = ws
    if TWO:
        ws2 = gl.allocate_shared_memory(dtype, [G, BLOCK_N, KCP], shared)
    xs = gl.allocate_shared_memory(dtype, [G, MP, KCP], shared)
    g = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, copy)))
    k = gl.arange(0, KS, layout=gl.SliceLayout(0, gl.SliceLayout(1, copy)))
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, copy)))
    rows = gl.minimum(n0 + n, N - 1)[None, :, None]  # past N: the last row again (masked)
    cols = g[:, None, None] * KC + k[None, None, :]  # [G, 1, KS]
    _copy_rows(ws, w_ptr, rows, cols, K, KS, KC)
    if TWO:
        _copy_rows(ws2, w_ptr, rows + OFF2, cols, K, KS, KC)
    cp.commit_group()
    _pdl_trigger_then_wait(USE_PDL)
    mma: gl.constexpr = gl.NVMMADistributedLayout([2, 0], [G, 1, 1], [1, 16, 8])
    if EPILOGUE == ROPE_KV:  # loaded now, their round trip ahead of the products
        ca, cb, sa, sb, slot = _rope_inputs(
            cos_ptr, sin_ptr, slot_ptr, stride_rt, tile, c0, M, Q_HEADS, KV_HEADS,
            TILE_STRIDE // 2, BLOCK_N, MP, gl.SliceLayout(0, mma),
        )  # fmt: skip
    _stage_rows(
        xs, x_ptr, r_ptr, total_ptr, nw_ptr, stats_ptr, cols, M, stride_xm, stride_rm,
        stride_tm, STATS_T, eps, gl.program_id(0) == 0, K, KS, KC, MP, NORM, ADD, STATS_IN,
        STATS_P2, copy,
    )  # fmt: skip
    cp.wait_group(0)
    gl.thread_barrier()
    acc = gl.zeros([G, BLOCK_N, MP], gl.float32, mma)
    acc2 = acc
    for s in gl.static_range(KC // KS):
        b = xs.slice(s * KS, KS, dim=2).permute([0, 2, 1]).load(gl.DotOperandLayout(1, mma, 2))
        acc = mma_v2(ws.slice(s * KS, KS, dim=2).load(gl.DotOperandLayout(0, mma, 2)), b, acc)
        if TWO:
            a2 = ws2.slice(s * KS, KS, dim=2).load(gl.DotOperandLayout(0, mma, 2))
            acc2 = mma_v2(a2, b, acc2)
    y = gl.sum(acc, axis=0)
    if EPILOGUE == PLAIN:
        _plain_epilogue(
            y, b_ptr, out_ptr, res_ptr, stats_ptr, n0, M, N, stride_om, stride_qm, STATS_T,
            BLOCK_N, MP, HAS_BIAS, STATS_OUT, ADD_OUT,
        )  # fmt: skip
    elif EPILOGUE == SWIGLU:
        _swiglu_epilogue(y, gl.sum(acc2, axis=0), out_ptr, n0, M, N, stride_om, BLOCK_N, MP)
    else:
        on = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, y.type.layout))
        y2 = gl.sum(acc2, axis=0)
        if HAS_BIAS:  # the projection's output, rounded as stored unfused
            y += gl.load(b_ptr + on).to(gl.float32)[:, None]
            y2 += gl.load(b_ptr + on + OFF2).to(gl.float32)[:, None]
        _rope_kv_epilogue(
            y.to(dtype).to(gl.float32), y2.to(dtype).to(gl.float32), tile, c0, M, out_ptr,
            stride_om, ca, cb, sa, sb, slot, kc_ptr, vc_ptr, stride_cs, stride_ch, Q_HEADS,
            KV_HEADS, TILE_STRIDE // 2, BLOCK_N, MP,
        )  # fmt: skip


@gluon.jit
def _stage_rows(
    xs, x_ptr, r_ptr, total_ptr, nw_ptr, stats_ptr, cols, M, stride_xm, stride_rm,
    stride_tm, STATS_T, eps, writer, K: gl.constexpr, KS: gl.constexpr, KC: gl.constexpr,
    MP: gl.constexpr, NORM: gl.constexpr, ADD: gl.constexpr, STATS_IN: gl.constexpr,
    STATS_P2: gl.constexpr, LAYOUT: gl.constexpr,
):  # fmt: skip
    """Stores the rows of x (``[G, MP, K / G]``, rows past M zero) to ``xs``: as they are,
    or with ``NORM`` normed (``writer`` storing ``x + residual`` with ``ADD``)."""
    dtype: gl.constexpr = xs.dtype
    m = gl.arange(0, MP, layout=gl.SliceLayout(0, gl.SliceLayout(2, LAYOUT)))[None, :, None]
    rstd = gl.zeros([1, MP, 1], gl.float32, LAYOUT)
    if NORM:
        rstd = _rstd(
            x_ptr, r_ptr, total_ptr, stats_ptr, m, cols, M, stride_xm, stride_rm, stride_tm,
            STATS_T, eps, writer, K, KS, KC, MP, ADD, STATS_IN, STATS_P2, LAYOUT,
        )  # fmt: skip
    # The rows go through registers (not cp.async): any row stride, and normed on the way.
    for s in gl.static_range(KC // KS):
        h = _rows_at(x_ptr, r_ptr, m, cols + s * KS, M, stride_xm, stride_rm, ADD)
        if NORM:
            if ADD and STATS_IN:
                if writer:  # with the statistics read, no pass over the rows stored it
                    live = (m < M) & (cols >= 0)
                    gl.store(total_ptr + m * stride_tm + cols + s * KS, h, mask=live)
            nw = gl.load(nw_ptr + cols + s * KS)
            y = (h.to(gl.float32) * rstd).to(dtype)
            h = (nw.to(gl.float32) * y.to(gl.float32)).to(dtype)
        xs.slice(s * KS, KS, dim=2).store(h)


@gluon.jit
def _swiglu_epilogue(y, u, out_ptr, n0, M, N, stride_om, BLOCK_N: gl.constexpr, MP: gl.constexpr):
    """Stores ``silu(gate) * up`` of the program's sums (``[BLOCK_N, MP]`` each), both
    rounded to the output dtype first and the product rounded once, as
    ``small_gemm``'s SWIGLU epilogue does."""
    dtype: gl.constexpr = out_ptr.dtype.element_ty
    on = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, y.type.layout))[:, None]
    om = gl.arange(0, MP, layout=gl.SliceLayout(0, y.type.layout))[None, :]
    g = y.to(dtype).to(gl.float32)
    z = g * (1 / (1 + gl.exp(-g))) * u.to(dtype).to(gl.float32)
    gl.store(out_ptr + om * stride_om + on, z.to(dtype), mask=(on < N) & (om < M))


@gluon.jit
def _rope_inputs(
    cos_ptr, sin_ptr, slot_ptr, stride_rt, head, c0, M, Q_HEADS, KV_HEADS,
    HALF: gl.constexpr, BLOCK_N: gl.constexpr, MP: gl.constexpr, L: gl.constexpr,
):  # fmt: skip
    """What ``_rope_kv_epilogue`` reads besides the sums, ``[BLOCK_N, MP]`` in layout
    ``L``: cos and sin at columns ``c0 .. c0 + BLOCK_N`` of each half head (for a key
    head; zeros for others, which load nothing) and each row's cache slot (for key and
    value heads; ``[1, MP]``)."""
    c = c0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))[:, None]
    mr = gl.arange(0, MP, layout=gl.SliceLayout(0, L))
    m = mr[None, :]
    # a uniform row bound: M where the head is of that kind, else 0
    key_rows = M * ((head >= Q_HEADS) & (head < Q_HEADS + KV_HEADS)).to(gl.int32)
    kv_rows = M * (head >= Q_HEADS).to(gl.int32)
    key = (m < key_rows) & (c < HALF)
    r = m * stride_rt + c
    ca = gl.load(cos_ptr + r, mask=key, other=0.0)
    cb = gl.load(cos_ptr + r + HALF, mask=key, other=0.0)
    sa = gl.load(sin_ptr + r, mask=key, other=0.0)
    sb = gl.load(sin_ptr + r + HALF, mask=key, other=0.0)
    slot = gl.load(slot_ptr + mr, mask=mr < kv_rows, other=0)[None, :]
    return ca, cb, sa, sb, slot


@gluon.jit
def _rope_kv_epilogue(
    a, b, head, c0, M, out_ptr, stride_om, ca, cb, sa, sb, slot, kc_ptr, vc_ptr, stride_cs,
    stride_ch, Q_HEADS, KV_HEADS, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
    MP: gl.constexpr,
):  # fmt: skip
    """Stores columns ``c0 .. c0 + BLOCK_N`` of each half (``a``, ``b``: ``[BLOCK_N,
    MP]``) of one head of a QKV projection's rows as ``small_gemm``'s ROPE_KV epilogue
    does: a query head to ``out`` unrotated, a key head rotated (rotate-half, float32,
    rounded once) and a value head as it is to their cache slots."""
    c = c0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a.type.layout))[:, None]
    m = gl.arange(0, MP, layout=gl.SliceLayout(0, a.type.layout))[None, :]
    rows = (m < M) & (c < HALF)
    if head < Q_HEADS:
        q = out_ptr + m * stride_om + head * 2 * HALF + c
        gl.store(q, a.to(out_ptr.dtype.element_ty), mask=rows)
        gl.store(q + HALF, b.to(out_ptr.dtype.element_ty), mask=rows)
    else:
        at = slot.to(gl.int64) * stride_cs + c
        if head < Q_HEADS + KV_HEADS:
            # rotate-half: [a, b] * cos + [-b, a] * sin
            ra = a * ca.to(gl.float32) + (-b) * sa.to(gl.float32)
            rb = b * cb.to(gl.float32) + a * sb.to(gl.float32)
            k = kc_ptr + at + (head - Q_HEADS) * stride_ch
            gl.store(k, ra.to(kc_ptr.dtype.element_ty), mask=rows)
            gl.store(k + HALF, rb.to(kc_ptr.dtype.element_ty), mask=rows)
        else:
            v = vc_ptr + at + (head - Q_HEADS - KV_HEADS) * stride_ch
            gl.store(v, a.to(vc_ptr.dtype.element_ty), mask=rows)
            gl.store(v + HALF, b.to(vc_ptr.dtype.element_ty), mask=rows)


@gluon.jit
def _plain_epilogue(
    y, b_ptr, out_ptr, res_ptr, stats_ptr, n0, M, N, stride_om, stride_qm, STATS_T,
    BLOCK_N: gl.constexpr, MP: gl.constexpr, HAS_BIAS: gl.constexpr,
    STATS_OUT: gl.constexpr, ADD_OUT: gl.constexpr,
):  # fmt: skip
    """Stores the program's sums ``y`` (``[BLOCK_N, MP]``: columns by rows) plus the bias;
    with ``STATS_OUT`` also the sum of squares of each row's ``y + residual`` over these
    ``BLOCK_N`` columns, rounded as ``small_gemm._residual_stats`` rounds (and, with
    ``ADD_OUT``, that sum in place of ``y``)."""
    dtype: gl.constexpr = out_ptr.dtype.element_ty
    on = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, y.type.layout))[:, None]
    om = gl.arange(0, MP, layout=gl.SliceLayout(0, y.type.layout))[None, :]
    mask = (on < N) & (om < M)
    if HAS_BIAS:
        y += gl.load(b_ptr + on, mask=on < N, other=0.0).to(gl.float32)
    if STATS_OUT:
        r = gl.load(res_ptr + om * stride_qm + on, mask=mask, other=0.0)
        h = (y.to(dtype).to(gl.float32) + r.to(gl.float32)).to(dtype).to(gl.float32)
        h = gl.where(mask, h, 0.0)
        ss = gl.sum(h * h, axis=0)[None, :]  # [1, MP]
        gl.store(stats_ptr + om * STATS_T + n0 // BLOCK_N, ss, mask=om < M)
        if ADD_OUT:
            y = h
    gl.store(out_ptr + om * stride_om + on, y.to(dtype), mask=mask)


def launch_smem(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: GemmConfig,
    *,
    epilogue: int,
    grid: tuple[int, int, int, int],
    norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None,
    stats: tuple[torch.Tensor, int, bool, bool],
    residual: torch.Tensor | None,
    add_out: bool,
    rope: tuple[tuple[torch.Tensor, ...], tuple[int, ...]],
    pdl: bool,
) -> None:
    """One launch of ``grid`` = (programs, programs per tile, tile stride, offset of the
    second tile's rows): ``out = x @ weight.T (+ bias)`` through ``epilogue`` (PLAIN,
    SWIGLU over ``n`` columns, ROPE_KV: ``rope`` as ``small_gemm._rope_args`` gives
    them); ``norm`` = (norm weight, residual or ``x``, total or ``x``, eps) with
    ``stats`` = (row statistics or ``x``, their columns per row, whether they are read,
    whether x has a residual); ``residual`` for the row statistics written
    (``STATS_OUT``). The caller (``small_gemm._launch``) has checked the shapes and that
    ``config`` fits."""
    m, k = x.shape
    programs, sub, tile_stride, off2 = grid
    n = out.shape[1] if epilogue != gemm_launch.ROPE_KV else weight.shape[0]
    stats_t, stats_in, add = stats[1], stats[2], stats[3]
    nw, res, total, eps = norm if norm is not None else (x, x, x, 0.0)
    q = residual if residual is not None else x
    (cos, sin, slots, kc, vc, _, _), ints = rope
    launch(
        _smem_gemm_kernel, (programs,),
        x, res, total, nw, weight, bias if bias is not None else weight, out, q, stats[0],
        cos, sin, slots, kc, vc,
        m, n, off2, x.stride(0), res.stride(0), total.stride(0), out.stride(0), q.stride(0),
        stats_t, eps, *ints,
        K=k, BLOCK_N=config.block_n, MP=8 if m <= 8 else 16, G=config.num_warps,
        KS=smem_k_step(k, config.num_warps), NORM=norm is not None, ADD=add,
        STATS_IN=stats_in, STATS_OUT=residual is not None, ADD_OUT=add_out,
        HAS_BIAS=bias is not None, STATS_P2=triton.next_power_of_2(stats_t),
        EPILOGUE=epilogue, SUB=sub, TILE_STRIDE=tile_stride, USE_PDL=pdl,
        num_warps=config.num_warps, launch_pdl=pdl,
    )  # fmt: skip
