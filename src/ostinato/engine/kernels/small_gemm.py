"""A Triton GEMM for projections of at most 16 rows (decode), with split-K.

``out[M, N] = x[M, K] @ w[N, K]^T (+ bias)``: a program per ``BLOCK_N`` output columns
and ``1/SPLIT_K`` of K, so even a narrow projection spreads its weight read over the
GPU. With ``SPLIT_K > 1`` each program stores its float32 partial tile, bumps a counter
per column tile, and the program that arrives last sums the partials, adds the bias,
writes the output and resets the counter to zero: the reduction needs no second kernel
(cuBLAS's split-K launches one) and the counters are zero again after every call, so a
captured graph replays on them.

``SWIGLU``: ``w`` is ``[2N, K]`` (gate rows, then up rows) and each program accumulates
its gate and up columns side by side and writes ``silu(gate) * up`` (both rounded to
the output dtype first, then the product in float32 rounded once, as the unfused
GEMM-then-Inductor-kernel does): a SwiGLU's gate/up projection and its activation in
one kernel.

With ``USE_PDL`` (programmatic dependent launch) a program starts pulling the first
``PREFETCH_K`` columns of its weight rows into L2 *before* waiting for the previous
kernel: weights do not depend on it, so their read overlaps its tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.launch import launch
from ostinato.engine.kernels.pdl import pdl_enter

MAX_ROWS = 16  # the one row tile of this GEMM (tl.dot's smallest M)

BLOCK_K = 128
PREFETCH_K = 512  # weight columns per row prefetched before the PDL wait
LINE = 64  # 16-bit elements per 128-byte cache line


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape of the small GEMM: output columns per program, K splits, warps."""

    block_n: int
    split_k: int
    num_warps: int = 4


# The candidates the start-up measurement tries (``gemm_tuning``); a plan entry ``i > 0``
# names ``CONFIGS[i - 1]``, 0 names cuBLAS. On the H100 the narrow 16-column tiles never
# won, so they are not tried.
CONFIGS: tuple[GemmConfig, ...] = (
    GemmConfig(32, 1),
    GemmConfig(32, 4),
    GemmConfig(64, 1),
    GemmConfig(64, 2),
)


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
def _small_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    N_PAD,
    K_PER,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    LINE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_PER  # K_PER: K / SPLIT_K in whole BLOCK_K tiles
    k_hi = tl.minimum(K, k_lo + K_PER)
    if USE_PDL:
        # Before the wait: start this program's weight read (rows clamped into range).
        lines = k_lo + tl.arange(0, PREFETCH_K // LINE) * LINE
        rows = tl.minimum(rn, N - 1)
        pre = w_ptr + rows[:, None] * stride_wn + tl.minimum(lines, K - 1)[None, :]
        _prefetch_l2(pre)
        if SWIGLU:
            _prefetch_l2(pre + N * stride_wn)
    pdl_enter(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K_PER, BLOCK_K):
        ks = k_lo + k0 + rk
        x_mask = (rm[:, None] < M) & (ks[None, :] < k_hi)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0)
        w_mask = (rn[None, :] < N) & (ks[:, None] < k_hi)
        w_ptrs = w_ptr + rn[None, :] * stride_wn + ks[:, None]
        acc = tl.dot(x, tl.load(w_ptrs, mask=w_mask, other=0.0), acc)
        if SWIGLU:
            up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
            acc_up = tl.dot(x, up, acc_up)
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    out_offs = rm[:, None] * stride_om + rn[None, :]
    dtype = out_ptr.dtype.element_ty
    if SPLIT_K > 1:
        # Partials laid out [SPLIT_K, 2, BLOCK_M, N_PAD]: every tile whole, no mask.
        tile = rm[:, None] * N_PAD + rn[None, :]
        mine = part_ptr + pid_k * 2 * BLOCK_M * N_PAD + tile
        tl.store(mine, acc)
        if SWIGLU:
            tl.store(mine + BLOCK_M * N_PAD, acc_up)
        # acq_rel: this program's partial is visible before its count, and the last
        # program sees every other partial after reading the count.
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        if last:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in tl.static_range(SPLIT_K):
                theirs = part_ptr + s * 2 * BLOCK_M * N_PAD + tile
                acc += tl.load(theirs, cache_modifier=".cg")
                if SWIGLU:
                    acc_up += tl.load(theirs + BLOCK_M * N_PAD, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
    else:
        last = True
    if last:
        if SWIGLU:
            g = acc.to(dtype).to(tl.float32)
            y = g * tl.sigmoid(g) * acc_up.to(dtype).to(tl.float32)
        else:
            y = acc
            if HAS_BIAS:
                y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, y.to(dtype), mask=out_mask)


def counters_needed(n: int) -> int:
    """Counter entries a projection with ``n`` output columns needs (one per column tile
    of the narrowest config)."""
    return triton.cdiv(n, min(c.block_n for c in CONFIGS))


def small_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    config: GemmConfig,
    swiglu: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a 2-D ``x`` of at most ``MAX_ROWS`` rows with a
    contiguous last dimension; with ``swiglu`` (no bias), ``silu(g) * u`` of its two
    halves ``[g | u]``. ``counters``: int32 zeros, at least ``counters_needed(N)``, not
    shared with a call that may run at the same time; zero again when the kernel ends."""
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError(
            f"small_gemm: needs x [<= {MAX_ROWS}, K] with a contiguous last dim and a "
            f"contiguous weight, got x {tuple(x.shape)} strides {x.stride()}"
        )
    m, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if weight.shape[1] != k or (swiglu and (bias is not None or weight.shape[0] % 2)):
        raise ValueError(
            f"small_gemm: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}"
            + (" (swiglu: an even row count, no bias)" if swiglu else "")
        )
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    if m == 0:
        return out
    tiles = triton.cdiv(n, config.block_n)
    n_pad = tiles * config.block_n
    if config.split_k > 1:
        if counters.numel() < tiles:
            raise ValueError(f"small_gemm: {counters.numel()} counters for {tiles} tiles")
        part = torch.empty(
            (config.split_k, 2, MAX_ROWS, n_pad), dtype=torch.float32, device=x.device
        )
    else:
        part = out
    launch(
        _small_gemm_kernel,
        (tiles, config.split_k),
        x,
        weight,
        bias if bias is not None else weight,
        out,
        part,
        counters,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        n_pad,
        triton.cdiv(triton.cdiv(k, config.split_k), BLOCK_K) * BLOCK_K,
        HAS_BIAS=bias is not None,
        SWIGLU=swiglu,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=BLOCK_K,
        SPLIT_K=config.split_k,
        PREFETCH_K=PREFETCH_K,
        LINE=LINE,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        launch_pdl=pdl,
    )
    return out
