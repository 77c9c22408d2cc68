"""RMSNorm as the custom ops ``ostinato::rms_norm`` and ``ostinato::add_rms_norm`` (the
residual add first: returns the norm of ``x + residual`` and that sum): on CUDA one
Triton kernel per call (a program per row), elsewhere the same arithmetic in torch.

Why an op: Inductor reduces a row wider than 1024 elements in two kernels (a looped
reduction, then the pointwise normalisation that re-reads the row), so every norm of a
decode graph cost two launches; one program holding the whole row does both.
The add inside the norm matters as much: left to Inductor, ``residual + mm(x, W)``
becomes cuBLAS ``addmm``, which first copies the residual into its output (a memcpy per
projection). Numerics follow transformers: the sum rounded to the input's dtype, the row
in float32, ``x * rsqrt(mean(x^2) + eps)`` cast back to the input's dtype, then times the
weight in the promoted dtype.
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("ostinato", "FRAGMENT")
_lib.define("rms_norm(Tensor x, Tensor weight, float eps, bool pdl=False) -> Tensor")
_lib.define(
    "add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool pdl=False) "
    "-> (Tensor, Tensor)"
)
_lib.define(
    "lora_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, Tensor s, "
    "Tensor b, Tensor slots, int max_loras, bool pdl=False) -> (Tensor, Tensor)"
)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.result_type(weight, x)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False
) -> torch.Tensor:
    """The torch arithmetic (CPU and any device without the kernel; ``pdl`` is a launch
    option of the kernel, ignored here)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    """Raises ValueError unless ``residual`` has ``x``'s shape and dtype."""
    # Every implementation (the fused ops' too): torch's add would broadcast a mismatched
    # residual silently.
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual "
            f"{tuple(residual.shape)} {residual.dtype} must match"
        )


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch arithmetic: (norm of ``x + residual``, ``x + residual``)."""
    check_residual(x, residual)
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


def _rms_norm_cuda(
    x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False
) -> torch.Tensor:
    from ostinato.engine.kernels.rms_norm import rms_norm_rows

    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    dim = x.shape[-1]
    rms_norm_rows(x.reshape(-1, dim), None, weight, eps, out.view(-1, dim), None, pdl)
    return out


def _add_rms_norm_cuda(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    pdl: bool = False,
    delta: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` in one kernel; with ``delta`` (``lora_add_rms_norm``'s ``s``,
    ``b``, ``slots``, ``max_loras``) each row's LoRA expand added to ``x`` first."""
    from ostinato.engine.kernels.rms_norm import rms_norm_rows

    check_residual(x, residual)
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    total = torch.empty_like(x, memory_format=torch.contiguous_format)
    dim = x.shape[-1]
    rows = (t.reshape(-1, dim) for t in (x, residual))
    rms_norm_rows(*rows, weight, eps, out.view(-1, dim), total.view(-1, dim), pdl, delta)
    return out, total


def lora_rows(
    x: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, max_loras: int
) -> torch.Tensor:
    """``x`` plus each row's LoRA expand (``model.lora.RowDelta``), summed in float32 and
    rounded to ``x``'s dtype, as the kernel does."""
    width = b.shape[0] // max_loras
    n = x.shape[0]
    row_slots = slots[:n]
    cols = row_slots.clamp(min=0)[:, None] * width + torch.arange(width, device=x.device)
    delta = torch.einsum("nw,nwd->nd", s.gather(1, cols).float(), b[cols].float())
    delta = delta * (row_slots >= 0)[:, None]
    return (x.float() + delta).to(x.dtype)


def lora_add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    s: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    max_loras: int,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch arithmetic: ``add_rms_norm`` of ``lora_rows(x, ...)`` and ``residual``."""
    return add_rms_norm_reference(lora_rows(x, s, b, slots, max_loras), residual, weight, eps)


def _lora_add_rms_norm_cuda(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    s: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    max_loras: int,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_rms_norm_cuda(x, residual, weight, eps, pdl, (s, b, slots, max_loras))


_lib.impl("rms_norm", rms_norm_reference, "CompositeExplicitAutograd")
_lib.impl("rms_norm", _rms_norm_cuda, "CUDA")
_lib.impl("add_rms_norm", add_rms_norm_reference, "CompositeExplicitAutograd")
_lib.impl("add_rms_norm", _add_rms_norm_cuda, "CUDA")
_lib.impl("lora_add_rms_norm", lora_add_rms_norm_reference, "CompositeExplicitAutograd")
_lib.impl("lora_add_rms_norm", _lora_add_rms_norm_cuda, "CUDA")


@torch.library.register_fake("ostinato::rms_norm", lib=_lib)
def _(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    return torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)


@torch.library.register_fake("ostinato::add_rms_norm", lib=_lib)
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    return out, torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.register_fake("ostinato::lora_add_rms_norm", lib=_lib)
def _(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    s: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    max_loras: int,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    return out, torch.empty(x.shape, dtype=x.dtype, device=x.device)
