"""Checked replays: FULL graphs compared with eager runs of the same step, at capture or
while serving, and a bucket that differs taken out of service.

- ``"capture"``: after each FULL capture, one replay is compared bitwise with an eager run
  of the same step; with a ``perturb_padding`` hook, the replay is run again after the
  padding rows got other contents, and the real rows must stay bitwise the same (a step
  that reduces over the padded batch leaks padding into real rows).
- ``"sample"``: the capture check, and while serving one FULL replay in ``every`` is run
  again eagerly and compared within the output dtype's tolerance (``tolerance``).

A bucket that fails is demoted: its steps run eagerly from then on, a
``GraphDemotedWarning`` names it and the difference, and the statistics count it. The
step that exposed it returns the eager outputs, so no wrong output leaves the manager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ostinato.batch import BatchDescriptor
from ostinato.mathutil import checked_int

CheckMode = Literal["off", "capture", "sample"]
DEFAULT_EVERY = 1024
"""Sampling rate: one replay in 1024 re-run eagerly. An eager step costs a few replays
(up to about 15 for a small model's decode, where launches dominate), so this keeps the
check near 1% of decode time even there."""


class GraphDemotedWarning(UserWarning):
    """A captured graph differed from eager and now runs eagerly."""


@dataclass(frozen=True)
class ReplayCheck:
    """Which replays are compared with eager runs. ``mode``: ``"off"``, ``"capture"`` or
    ``"sample"`` (see the module); ``every``: the sampling period in FULL replays."""

    mode: CheckMode = "off"
    every: int = DEFAULT_EVERY

    def __post_init__(self) -> None:
        if self.mode not in ("off", "capture", "sample"):
            raise ValueError(f"verify: {self.mode!r}; use 'off', 'capture' or 'sample'")
        checked_int("verify_every", self.every)

    @property
    def at_capture(self) -> bool:
        return self.mode == "capture"

    @property
    def sampling(self) -> bool:
        return self.mode == "sample"

    @staticmethod
    def chosen(verify_graphs: bool, check: ReplayCheck | None) -> ReplayCheck:
        """The check a ``GraphManager`` runs: ``check``, or the capture check where
        ``verify_graphs`` (its older spelling), else none; ``ValueError`` where both ask
        for different checks (one of them would be lost)."""
        if verify_graphs and check is not None and check.mode != "capture":
            raise ValueError(
                f"GraphManager: verify_graphs=True is check=ReplayCheck('capture'); not with "
                f"check={check!r} (give one of them)"
            )
        return check or ReplayCheck("capture" if verify_graphs else "off")


@dataclass(frozen=True)
class Mismatch:
    """The first output of a step whose replay and eager run differ: ``output`` (its index),
    ``rows`` compared, the largest absolute difference and the tolerance it broke."""

    output: int
    rows: int
    max_diff: float
    atol: float
    rtol: float

    def describe(self, descriptor: BatchDescriptor, what: str) -> str:
        bound = "bitwise" if self.atol == self.rtol == 0 else f"atol {self.atol}, rtol {self.rtol}"
        return (
            f"the FULL graph for {descriptor} {what}: output #{self.output} differs in its "
            f"first {self.rows} rows by up to {self.max_diff:.3g} ({bound})"
        )


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for comparing a replay with an eager run: exact for integers and
    booleans, else ``torch.testing``'s defaults for the dtype."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return 0.0, 0.0
    rtol = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float32: 1.3e-6}.get(dtype, 1e-7)
    atol = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-5}.get(dtype, 1e-7)
    return atol, rtol


def first_mismatch(
    replayed: tuple[torch.Tensor, ...], eager: tuple[torch.Tensor, ...], rows: int, exact: bool
) -> Mismatch | None:
    """The first output whose first ``rows`` rows differ (bitwise when ``exact``, else
    beyond ``tolerance``), or None."""
    for i, (r, e) in enumerate(zip(replayed, eager, strict=True)):
        r, e = r[:rows], e[:rows]
        atol, rtol = (0.0, 0.0) if exact else tolerance(r.dtype)
        same = torch.equal(r, e) if exact else torch.allclose(r, e, rtol=rtol, atol=atol)
        if not same:
            diff = (r.double() - e.double()).abs().max().item() if r.numel() else 0.0
            return Mismatch(i, rows, diff, atol, rtol)
    return None
