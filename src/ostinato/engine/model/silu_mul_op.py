"""SwiGLU's activation as the custom op ``ostinato::silu_mul``: ``silu(g) * u`` of the two
halves ``[g | u]`` of a gate/up projection's output, on CUDA one Triton kernel per call
(``triton_silu_mul``), elsewhere the same arithmetic in torch.

Why an op: in eager code (the FULL graphs of an uncompiled model, pieces compiled
without Inductor) ``F.silu(g) * u`` is two kernels and writes and re-reads an
intermediate as large as the output; the kernel reads ``[g | u]`` once and writes the
output once. Numerics are Inductor's fused kernel's: float32 inside, rounded once to the
input's dtype (eager torch rounds twice, after the SiLU and after the product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_lib = torch.library.Library("ostinato", "FRAGMENT")
_lib.define("silu_mul(Tensor x, bool pdl=False) -> Tensor")


def _check(x: torch.Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(
            f"silu_mul: the last dim holds [gate | up] and must be even, got {tuple(x.shape)}"
        )


def silu_mul_reference(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``silu(x[..., :K]) * x[..., K:]`` in torch, float32 inside and rounded once (``pdl``
    is a launch option of the kernel, ignored here)."""
    _check(x)
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def _silu_mul_cuda(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    from ostinato.engine.kernels.silu_mul import silu_mul

    _check(x)
    half = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], half), dtype=x.dtype, device=x.device)
    silu_mul(x.reshape(-1, 2 * half), pdl, out.view(-1, half))
    return out


_lib.impl("silu_mul", silu_mul_reference, "CompositeExplicitAutograd")
_lib.impl("silu_mul", _silu_mul_cuda, "CUDA")


@torch.library.register_fake("ostinato::silu_mul", lib=_lib)
def _(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    _check(x)
    return torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
