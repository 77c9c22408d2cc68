"""The RMSNorm kernel behind ``ostinato::rms_norm`` on CUDA: one program per row, the
whole row in registers, so a norm is one launch at any row count."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, dim, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / dim
    y = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)  # back to the input dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """``out[r] = weight * rms_norm(x[r])`` for every row of the 2-D ``x`` (any row
    stride, contiguous rows)."""
    rows, dim = x.shape
    if rows == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows,)](
        x,
        weight,
        out,
        x.stride(0),
        out.stride(0),
        dim,
        eps,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
