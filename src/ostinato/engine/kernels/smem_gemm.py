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
  ``PLAIN`` epilogue runs: the bias, and with ``STATS_OUT`` the row statistics of the
  sum with the residual (one ``GRANULE`` entry a row, ``BLOCK_N == GRANULE``), storing
  that sum with ``ADD_OUT``.

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

from ostinato.engine.kernels.gemm_launch import GemmConfig, smem_k_step
from ostinato.engine.kernels.launch import launch


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
def _smem_gemm_kernel(
    x_ptr, r_ptr, total_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, res_ptr, stats_ptr,
    M, N, stride_xm, stride_rm, stride_tm, stride_om, stride_qm, STATS_T, eps,
    K: gl.constexpr, BLOCK_N: gl.constexpr, MP: gl.constexpr, G: gl.constexpr,
    KS: gl.constexpr, NORM: gl.constexpr, ADD: gl.constexpr, STATS_IN: gl.constexpr,
    STATS_OUT: gl.constexpr, ADD_OUT: gl.constexpr, HAS_BIAS: gl.constexpr,
    STATS_P2: gl.constexpr, USE_PDL: gl.constexpr,
):  # fmt: skip
    KC: gl.constexpr = K // G
    KCP: gl.constexpr = triton.next_power_of_2(KC)  # a buffer's sides are powers of two
    dtype: gl.constexpr = w_ptr.dtype.element_ty
    n0 = gl.program_id(0) * BLOCK_N
    copy: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [G, 1, 1], [2, 1, 0])
    shared: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0])
    ws = gl.allocate_shared_memory(dtype, [G, BLOCK_N, KCP], shared)
    xs = gl.allocate_shared_memory(dtype, [G, MP, KCP], shared)
    g = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, copy)))
    k = gl.arange(0, KS, layout=gl.SliceLayout(0, gl.SliceLayout(1, copy)))
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, copy)))
    rows = gl.minimum(n0 + n, N - 1)  # past N: the last row again (its outputs masked)
    cols = g[:, None, None] * KC + k[None, None, :]  # [G, 1, KS]
    for s in gl.static_range(KC // KS):
        w_at = w_ptr + rows[None, :, None] * K + cols + s * KS
        cp.async_copy_global_to_shared(ws.slice(s * KS, KS, dim=2), w_at)
    cp.commit_group()
    _pdl_trigger_then_wait(USE_PDL)
    m = gl.arange(0, MP, layout=gl.SliceLayout(0, gl.SliceLayout(2, copy)))[None, :, None]
    rstd = gl.zeros([1, MP, 1], gl.float32, copy)
    if NORM:
        rstd = _rstd(
            x_ptr, r_ptr, total_ptr, stats_ptr, m, cols, M, stride_xm, stride_rm, stride_tm,
            STATS_T, eps, n0 == 0, K, KS, KC, MP, ADD, STATS_IN, STATS_P2, copy,
        )  # fmt: skip
    # The rows go through registers (not cp.async): any row stride, and normed on the way.
    for s in gl.static_range(KC // KS):
        h = _rows_at(x_ptr, r_ptr, m, cols + s * KS, M, stride_xm, stride_rm, ADD)
        if NORM:
            if ADD and STATS_IN:
                if n0 == 0:  # with the statistics read, no pass over the rows stored it
                    live = (m < M) & (cols >= 0)
                    gl.store(total_ptr + m * stride_tm + cols + s * KS, h, mask=live)
            nw = gl.load(nw_ptr + cols + s * KS)
            y = (h.to(gl.float32) * rstd).to(dtype)
            h = (nw.to(gl.float32) * y.to(gl.float32)).to(dtype)
        xs.slice(s * KS, KS, dim=2).store(h)
    cp.wait_group(0)
    gl.thread_barrier()
    mma: gl.constexpr = gl.NVMMADistributedLayout([2, 0], [G, 1, 1], [1, 16, 8])
    acc = gl.zeros([G, BLOCK_N, MP], gl.float32, mma)
    for s in gl.static_range(KC // KS):
        a = ws.slice(s * KS, KS, dim=2).load(gl.DotOperandLayout(0, mma, 2))
        b = xs.slice(s * KS, KS, dim=2).permute([0, 2, 1]).load(gl.DotOperandLayout(1, mma, 2))
        acc = mma_v2(a, b, acc)
    _plain_epilogue(
        gl.sum(acc, axis=0), b_ptr, out_ptr, res_ptr, stats_ptr, n0, M, N, stride_om,
        stride_qm, STATS_T, BLOCK_N, MP, HAS_BIAS, STATS_OUT, ADD_OUT,
    )  # fmt: skip


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
    norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None,
    stats: tuple[torch.Tensor, int, bool, bool],
    residual: torch.Tensor | None,
    add_out: bool,
    pdl: bool,
) -> None:
    """One launch over ``cdiv(N, block_n)`` programs: ``out = x @ weight.T (+ bias)``;
    ``norm`` = (norm weight, residual or ``x``, total or ``x``, eps) with ``stats`` =
    (row statistics or ``x``, their columns per row, whether they are read, whether x
    has a residual); ``residual`` for the row statistics written (``STATS_OUT``). The
    caller (``small_gemm._launch``) has checked the shapes and that ``config`` fits."""
    m, k = x.shape
    n = weight.shape[0]
    stats_t, stats_in, add = stats[1], stats[2], stats[3]
    nw, res, total, eps = norm if norm is not None else (x, x, x, 0.0)
    q = residual if residual is not None else x
    launch(
        _smem_gemm_kernel, (triton.cdiv(n, config.block_n),),
        x, res, total, nw, weight, bias if bias is not None else weight, out, q, stats[0],
        m, n, x.stride(0), res.stride(0), total.stride(0), out.stride(0), q.stride(0),
        stats_t, eps,
        K=k, BLOCK_N=config.block_n, MP=8 if m <= 8 else 16, G=config.num_warps,
        KS=smem_k_step(k, config.num_warps), NORM=norm is not None, ADD=add,
        STATS_IN=stats_in, STATS_OUT=residual is not None, ADD_OUT=add_out,
        HAS_BIAS=bias is not None, STATS_P2=triton.next_power_of_2(stats_t),
        USE_PDL=pdl, num_warps=config.num_warps, launch_pdl=pdl,
    )  # fmt: skip
