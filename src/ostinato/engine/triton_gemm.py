"""A Triton GEMM for projections of at most 16 rows (decode), with split-K.

``out[M, N] = x[M, K] @ w[N, K]^T (+ bias)``: a program per ``BLOCK_N`` output columns
and ``1/SPLIT_K`` of K, so even a narrow projection spreads its weight read over the
GPU. With ``SPLIT_K > 1`` each program stores its float32 partial tile, bumps a counter
per column tile, and the program that arrives last sums the partials, adds the bias,
writes the output and resets the counter to zero: the reduction needs no second kernel
(cuBLAS's split-K launches one) and the counters are zero again after every call, so a
captured graph replays on them. ``SILU_MUL``: ``x`` is ``[M, 2K]`` (gate | up) and the
kernel multiplies ``silu(gate) * up`` as it loads, in float32, rounded once to the
weight's dtype (as Inductor's fused SiLU·mul does), so the down projection of a SwiGLU
needs no kernel before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ostinato.engine.linear import MAX_ROWS
from ostinato.engine.triton_pdl import pdl_enter

BLOCK_K = 128


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape of the small GEMM: output columns per program, K splits, warps."""

    block_n: int
    split_k: int
    num_warps: int = 4


# The candidates the start-up measurement tries (``gemm_tuning``); a plan entry ``i > 0``
# names ``CONFIGS[i - 1]``, 0 names cuBLAS.
CONFIGS: tuple[GemmConfig, ...] = (
    GemmConfig(16, 1),
    GemmConfig(16, 2),
    GemmConfig(16, 4),
    GemmConfig(32, 1),
    GemmConfig(32, 4),
    GemmConfig(64, 1),
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
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_PER  # K_PER: K / SPLIT_K in whole BLOCK_K tiles
    k_hi = tl.minimum(K, k_lo + K_PER)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K_PER, BLOCK_K):
        ks = k_lo + k0 + rk
        x_mask = (rm[:, None] < M) & (ks[None, :] < k_hi)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0)
        if SILU_MUL:
            u = tl.load(x_ptr + rm[:, None] * stride_xm + K + ks[None, :], mask=x_mask, other=0.0)
            g = x.to(tl.float32)
            x = (g * tl.sigmoid(g) * u.to(tl.float32)).to(w_ptr.dtype.element_ty)
        w_mask = (rn[None, :] < N) & (ks[:, None] < k_hi)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(x, w, acc)
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    out_offs = rm[:, None] * stride_om + rn[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials laid out [SPLIT_K, BLOCK_M, N_PAD]: every tile is whole, no mask.
        tile = rm[:, None] * N_PAD + rn[None, :]
        tl.store(part_ptr + pid_k * BLOCK_M * N_PAD + tile, acc)
        # acq_rel: this program's partial is visible before its count, and the last
        # program sees every other partial after reading the count.
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * BLOCK_M * N_PAD + tile, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, K, stride_xm, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    g = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_xm + K + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * K + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


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
    silu_mul: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` (with ``silu_mul``: of ``silu(x[:, :K]) * x[:, K:]``) for
    a 2-D ``x`` of at most ``MAX_ROWS`` rows with a contiguous last dimension.
    ``counters``: int32 zeros, at least ``counters_needed(N)``, not shared with a call
    that may run at the same time; they are zero again when the kernel ends."""
    m = x.shape[0]
    n, k = weight.shape
    if m > MAX_ROWS or x.dim() != 2 or x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError(
            f"small_gemm: needs x [<= {MAX_ROWS}, K] with a contiguous last dim and a "
            f"contiguous weight, got x {tuple(x.shape)} strides {x.stride()}"
        )
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"small_gemm: x {tuple(x.shape)} does not fit weight {(n, k)}")
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    if m == 0:
        return out
    tiles = triton.cdiv(n, config.block_n)
    n_pad = tiles * config.block_n
    if config.split_k > 1:
        if counters.numel() < tiles:
            raise ValueError(f"small_gemm: {counters.numel()} counters for {tiles} tiles")
        part = torch.empty((config.split_k, MAX_ROWS, n_pad), dtype=torch.float32, device=x.device)
    else:
        part = out
    _small_gemm_kernel[(tiles, config.split_k)](
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
        SILU_MUL=silu_mul,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=BLOCK_K,
        SPLIT_K=config.split_k,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        launch_pdl=pdl,
    )
    return out


def silu_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``silu(x[:, :K]) * x[:, K:]`` for a 2-D ``x`` ``[M, 2K]`` in one kernel (float32
    inside, rounded once)."""
    m, two_k = x.shape
    k = two_k // 2
    out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    block = min(1024, triton.next_power_of_2(k))
    _silu_mul_kernel[(m, triton.cdiv(k, block))](
        x, out, k, x.stride(0), BLOCK=block, USE_PDL=pdl, num_warps=4, launch_pdl=pdl
    )
    return out
