"""RMSNorm as the custom op ``ostinato::rms_norm``: on CUDA one Triton kernel per call
(a program per row), elsewhere the same float32 arithmetic in torch.

Why an op: Inductor reduces a row wider than 1024 elements in two kernels (a looped
reduction, then the pointwise normalisation that re-reads the row), so every norm of a
decode graph cost two launches; one program holding the whole row does both.
Numerics follow transformers: the row in float32, ``x * rsqrt(mean(x^2) + eps)`` cast
back to the input's dtype, then times the weight in the promoted dtype.
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("ostinato", "FRAGMENT")
_lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.result_type(weight, x)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch arithmetic (CPU and any device without the kernel)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from ostinato.engine.triton_norm import rms_norm_rows

    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    rms_norm_rows(x.reshape(-1, x.shape[-1]), weight, eps, out.view(-1, x.shape[-1]))
    return out


_lib.impl("rms_norm", rms_norm_reference, "CompositeExplicitAutograd")
_lib.impl("rms_norm", _rms_norm_cuda, "CUDA")


@torch.library.register_fake("ostinato::rms_norm", lib=_lib)
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
