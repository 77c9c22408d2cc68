"""The RMSNorm kernel behind ``ostinato::rms_norm`` and ``ostinato::add_rms_norm`` on
CUDA: one program per row, the whole row in registers, so a norm (with the residual add
before it) is one launch at any row count."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.launch import launch, pdl_arg, pdl_for
from ostinato.engine.kernels.pdl import pdl_enter


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    total_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_t,
    dim,
    eps,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # as x + r
        tl.store(total_ptr + row * stride_t + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / dim
    y = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)  # back to the input dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_rows(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    total: torch.Tensor | None,
    pdl: bool = False,
) -> None:
    """``out[r] = weight * rms_norm(x[r] (+ residual[r]))`` for every row of the 2-D
    ``x`` (any row stride); with ``residual``, ``total[r] = x[r] + residual[r]`` too.
    ``pdl``: launch with programmatic dependent launch (compute capability 9.0+) when
    ``pdl_for`` allows it for this many rows."""
    rows, dim = x.shape
    if rows == 0:
        return
    pdl = pdl_for(pdl, rows)
    if x.stride(-1) != 1:
        x = x.contiguous()
    add = residual is not None and total is not None
    if add and residual.stride(-1) != 1:
        residual = residual.contiguous()
    r = residual if add else x
    t = total if add else out
    block = triton.next_power_of_2(dim)
    launch(
        _rms_norm_kernel,
        (rows,),
        x,
        r,
        weight,
        out,
        t,
        x.stride(0),
        r.stride(0),
        out.stride(0),
        t.stride(0),
        dim,
        eps,
        ADD=add,
        BLOCK=block,
        USE_PDL=pdl_arg(pdl),
        num_warps=min(16, max(1, block // 256)),
        launch_pdl=pdl,
    )
