"""The SiLU·mul kernel behind ``ostinato::silu_mul`` on CUDA (and after a cuBLAS gate/up
projection in the small-GEMM plans): a program per (row, block of columns) reads the gate
and up halves once and writes their product once, in float32 inside and rounded once, as
Inductor's fused kernel and the small GEMM's epilogue compute it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.launch import launch, pdl_arg, pdl_for
from ostinato.engine.kernels.pdl import pdl_enter


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr, K, stride_xm, stride_om, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    g = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_xm + K + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor, pdl: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :K]) * x[:, K:]`` for a 2-D ``x`` ``[M, 2K]`` (any row stride) in one
    kernel, into ``out`` (``[M, K]``, any row stride) when given. ``pdl``: launch with
    programmatic dependent launch (compute capability 9.0+) where ``pdl_for`` allows."""
    m, two_k = x.shape
    k = two_k // 2
    if out is None:
        out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0 or k == 0:
        return out
    pdl = pdl_for(pdl, m)
    if x.stride(-1) != 1:
        x = x.contiguous()
    block = min(1024, triton.next_power_of_2(k))
    launch(
_silu_mul_kernel,
(m, triton.cdiv(k, block)),
        x, out, k, x.stride(0), out.stride(0), BLOCK=block, USE_PDL=pdl_arg(pdl), num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip
    return out
