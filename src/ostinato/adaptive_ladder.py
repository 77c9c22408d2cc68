"""An adaptive capture ladder: between steps, the FULL sizes move to those that pad least
for the traffic seen so far, within a memory budget, a bounded number of times.

``AdaptiveLadder.between_steps()`` is called by the caller after each step, when no step
is in flight. Every ``every`` calls it plans sizes from the manager's live histogram of
step sizes (``capture_planner``, charging each size what the captures measured:
``device_costs`` of the capture report) and, if the plan pads at least
``min_gain`` less than the ladder held (or the ladder held is over the budget), moves
the manager to it (``GraphManager.resize``:
the new graphs are captured before the dropped ones go). Guarantees: nothing is captured
or released inside a step; at most ``max_resizes`` moves over the ladder's life; the
largest size never changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ostinato.capture_planner import device_costs, padded_rows, plan_capture_sizes
from ostinato.manager import GraphManager
from ostinato.mathutil import checked_int
from ostinato.modes import GraphMode


@dataclass(frozen=True)
class AdaptivePolicy:
    """``budget_bytes`` of device memory the ladder's graphs may be charged (in
    ``granule`` units, as ``plan_capture_sizes`` charges); a look every ``every`` steps; at most
    ``max_resizes`` moves; a move only for at least ``min_gain`` (a share) fewer padded
    rows on the histogram seen."""

    budget_bytes: int
    every: int = 4096
    max_resizes: int = 8
    min_gain: float = 0.1
    granule: int = 1 << 20

    def __post_init__(self) -> None:
        checked_int("budget_bytes", self.budget_bytes)
        checked_int("every", self.every)
        checked_int("max_resizes", self.max_resizes, least=0)
        checked_int("granule", self.granule)
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain: a share in [0, 1), got {self.min_gain!r}")


@dataclass(frozen=True)
class LadderChange:
    """One move: the sizes added and dropped, and the padded rows the histogram seen
    would have cost on the old ladder and costs on the new one."""

    added: tuple[int, ...]
    dropped: tuple[int, ...]
    padded_before: int
    padded_after: int


class AdaptiveLadder:
    """Moves ``manager``'s FULL ladder as ``policy`` says (see the module)."""

    def __init__(self, manager: GraphManager, policy: AdaptivePolicy) -> None:
        self.manager = manager
        self.policy = policy
        self.steps = 0
        self.changes: list[LadderChange] = []

    def between_steps(self) -> LadderChange | None:
        """Counts a step; on every ``every``-th, plans and maybe moves the ladder."""
        self.steps += 1
        policy = self.policy
        if self.steps % policy.every or len(self.changes) >= policy.max_resizes:
            return None
        histogram = self.manager.stats().step_sizes
        sizes = self.manager.dispatcher.sizes
        before = padded_rows(histogram, sizes)
        records = self.manager.report.records
        if before == 0 or not any(r.mode is GraphMode.FULL for r in records):
            return None
        cost = device_costs(records)
        max_size = self.manager.dispatcher.max_size
        budget, granule = policy.budget_bytes, policy.granule
        plan = plan_capture_sizes(histogram, max_size, budget, cost, granule)
        held = sum(cost(n) for n in sizes)
        worth = before - plan.padded_rows >= policy.min_gain * before
        if plan.sizes == tuple(sizes) or not (worth or held > policy.budget_bytes):
            return None
        added, dropped = self.manager.resize(plan.sizes)
        change = LadderChange(added, dropped, before, plan.padded_rows)
        self.changes.append(change)
        return change
