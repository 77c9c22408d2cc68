"""Projections that can run small row counts through the tuned Triton GEMM.

``Linear`` is ``nn.Linear`` (same parameters, same state dict) plus a *plan*: for each
row count ``m`` up to the kernel's row tile (``plan[m]``), 0 for cuBLAS or ``i`` for
``triton_gemm.CONFIGS[i - 1]``, chosen at start-up by ``gemm_tuning`` from measurements
on this device. Without a plan it is exactly ``nn.Linear``. With one, it calls the custom
op ``ostinato::linear``, opaque to torch.compile, which picks per call from the row
count: the plan is a constant of the compiled graph, so one compilation serves every
size, and a captured graph holds whichever kernel the plan named for its size.
``forward_swiglu`` is a SwiGLU's gate/up projection with its activation: ``silu(g) * u``
of the two output halves ``[g | u]``, fused into the GEMM's epilogue where the plan picks
Triton (one kernel instead of the GEMM and the ``ostinato::silu_mul`` kernel).
``forward_stats`` is a projection that ends a residual branch: beside the projection it
returns, where the plan picks Triton, the row statistics of its sum with the residual,
from which the next fused norm takes its sums of squares (``ostinato::linear_stats``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.engine.kernels.gemm_launch import MAX_ROWS, stats_columns
from ostinato.engine.model.silu_mul_op import silu_mul_reference

_lib = torch.library.Library("ostinato", "FRAGMENT")
_lib.define(
    "linear(Tensor x, Tensor weight, Tensor? bias, Tensor counters, int[] plan, "
    "bool swiglu=False, bool pdl=False) -> Tensor"
)


def plan_entry(plan: Sequence[int], rows: int) -> int:
    """``plan``'s entry for ``rows`` rows: 1 + an index into ``CONFIGS``, or 0 (cuBLAS),
    as for every row count past the plan's end."""
    return plan[rows] if rows < len(plan) else 0


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    plan: list[int],
    swiglu: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    if not x.is_cuda:  # the arithmetic the plan must reproduce; counters and pdl unused
        y = F.linear(x, weight, bias)
        return silu_mul_reference(y) if swiglu else y
    from ostinato.engine.kernels import small_gemm as triton_gemm
    from ostinato.engine.kernels.silu_mul import silu_mul

    choice = plan_entry(plan, x.shape[0])
    if choice:
        return triton_gemm.small_gemm(
            x, weight, bias, counters, triton_gemm.CONFIGS[choice - 1], swiglu, pdl
        )
    y = F.linear(x, weight, bias)
    return silu_mul(y, pdl) if swiglu else y


_lib.impl("linear", _linear, "CompositeExplicitAutograd")


@torch.library.register_fake("ostinato::linear", lib=_lib)
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    plan: list[int],
    swiglu: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    return x.new_empty((x.shape[0], n), dtype=weight.dtype)


_lib.define(
    "linear_stats(Tensor x, Tensor weight, Tensor? bias, Tensor counters, int[] plan, "
    "Tensor residual, bool pdl=False) -> (Tensor, Tensor)"
)


def kernel_rows(x: torch.Tensor, weight: torch.Tensor, plan: list[int]) -> int:
    """The plan entry under which the Triton GEMM runs ``x``'s rows (0: it does not):
    CUDA, 16-bit weights, rows of the weight's dtype with a contiguous last dimension.
    The one predicate of both sides of a row-statistics hand-over (``linear_stats``
    writes them exactly where this is nonzero for its rows, plan and weight)."""
    if not x.is_cuda or weight.dtype not in (torch.float16, torch.bfloat16):
        return 0
    return plan_entry(plan, x.shape[0]) if x.dtype == weight.dtype and x.stride(-1) == 1 else 0


def _linear_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    plan: list[int],
    residual: torch.Tensor,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    stats = torch.empty(
        (MAX_ROWS, stats_columns(weight.shape[0])), dtype=torch.float32, device=x.device
    )
    choice = kernel_rows(x, weight, plan)
    if not choice:  # no statistics: the next norm sums its rows' squares itself
        return _linear(x, weight, bias, counters, plan, False, pdl), stats
    from ostinato.engine.kernels import small_gemm as triton_gemm

    after = triton_gemm.ResidualStats(residual.contiguous(), stats)
    config = triton_gemm.CONFIGS[choice - 1]
    y = triton_gemm.small_gemm(x, weight, bias, counters, config, False, pdl, None, after)
    return y, stats


_lib.impl("linear_stats", _linear_stats, "CompositeExplicitAutograd")


@torch.library.register_fake("ostinato::linear_stats", lib=_lib)
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    plan: list[int],
    residual: torch.Tensor,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.new_empty((x.shape[0], weight.shape[0]), dtype=weight.dtype)
    return h, x.new_empty((MAX_ROWS, stats_columns(weight.shape[0])), dtype=torch.float32)


class Linear(nn.Linear):
    """``nn.Linear`` with an optional small-row plan (see the module docstring).

    Guarantees: without a plan, ``forward`` is ``nn.Linear.forward`` and
    ``forward_swiglu`` is ``nn.Linear.forward`` then ``ostinato::silu_mul``; with
    one, the same function (to the GEMM's summation order) through ``ostinato::linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.plan: tuple[int, ...] = ()
        self.pdl = False
        # The split-K counters of a plan (``use_plan``); none until one is given.
        self.register_buffer("counters", torch.zeros(0, dtype=torch.int32), persistent=False)

    def use_plan(self, plan: tuple[int, ...], counters: int | torch.Tensor, pdl: bool) -> None:
        """Routes row counts through ``plan`` (empty: plain ``nn.Linear`` again), with
        ``counters`` zeroed split-K counters on the weight's device (a count, or the
        tensor ``new_counters`` made beforehand: no device work here then)."""
        if isinstance(counters, int):
            counters = self.new_counters(counters)
        self.plan = tuple(plan)
        self.pdl = pdl
        # Not persistent: scratch, not state; the kernel leaves them zero after each call.
        self.register_buffer("counters", counters, persistent=False)

    def new_counters(self, count: int) -> torch.Tensor:
        """``count`` zeroed split-K counters on the weight's device, for ``use_plan``."""
        return torch.zeros(count, dtype=torch.int32, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.plan:
            return super().forward(x)
        return torch.ops.ostinato.linear(
            x, self.weight, self.bias, self.counters, list(self.plan), False, self.pdl
        )

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``forward(x)``, the same bits, written into ``out`` and returned where cuBLAS
        (or the CPU's matmul) computes it: 2-D ``x``, no bias, no plan entry for these
        rows, ``out`` contiguous in the output's shape and dtype, nothing to
        differentiate. Elsewhere ``forward``'s own tensor, ``out`` untouched."""
        m = x.shape[0]
        planned = x.is_cuda and plan_entry(self.plan, m) != 0  # as ``_linear`` decides
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        fits = (
            not grad
            and x.dim() == 2
            and self.bias is None
            and out.shape == (m, self.out_features)
            and out.dtype == x.dtype == self.weight.dtype
            and out.is_contiguous()
        )
        if planned or not fits:
            return self(x)
        # F.linear of 2-D rows without a bias is this product (aten::linear -> mm).
        return torch.mm(x, self.weight.t(), out=out)

    def forward_stats(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(``forward(x)``, the row statistics of ``forward(x) + residual``: float32
        ``[MAX_ROWS, out / 16]``, written only where ``kernel_rows(x, weight, plan)``;
        ``ostinato::linear_stats``)."""
        plan = list(self.plan)
        return torch.ops.ostinato.linear_stats(
            x, self.weight, self.bias, self.counters, plan, residual, self.pdl
        )

    def forward_swiglu(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """``silu(g) * u`` where ``[g | u]`` is this projection of ``x`` (``[m, out / 2]``);
        unplanned, the activation is ``ostinato::silu_mul``, launched with ``pdl``."""
        if not self.plan:
            return torch.ops.ostinato.silu_mul(super().forward(x), pdl)
        return torch.ops.ostinato.linear(
            x, self.weight, self.bias, self.counters, list(self.plan), True, self.pdl
        )
