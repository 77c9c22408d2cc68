"""Kernel plans measured after the graphs: the second half of a deferred plan.

A background start whose plans are not in the compile cache runs the rules' plans
(``KernelPlan.plan(defer=True)``) and captures its graphs with them. ``DeferredPlans``
then runs on the capture thread as the capture's ``afterwards``: it measures the real
plans on scratch inputs of its own (``KernelPlan.measure_deferred``; every timing holds
the step turn, handed back between timings, so steps go on), and captures again each
FULL graph of a size whose kernels the measured plans change (``GraphManager.recapture``:
the shared pool, the same static outputs), keeping whichever of the two replays faster.
Where the rules' graphs won at a size, the model and the compile cache take the rules'
kernels back there (``KernelPlan.keep_rules_at``): a later start captures what won.

Guarantees: the graphs change between steps only; a failure leaves every graph as it was
(the background capture logs it); ``finish`` (before the runner's release) lets a
measurement still to come or under way end first, so that the next start reads the plans.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from typing import Protocol

import torch

from ostinato.batch import BatchDescriptor
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.worker.inputs import StepInputs
from ostinato.engine.worker.kernel_plan import KernelPlan
from ostinato.engine.worker.layer_tuning import StepTimer
from ostinato.manager import GraphManager, KeepNew
from ostinato.modes import GraphMode
from ostinato.platform.base import Held
from ostinato.runtime import GraphRuntime

logger = logging.getLogger(__name__)

# Seconds of ``calls`` calls of a function, queued inside ``held()`` (``Platform.held_seconds``)
HeldTimer = Callable[[Callable[[], object], int, Held], float]


class Measurable(Protocol):
    """What ``DeferredPlans`` reads of its runner (``ModelRunner``; named here, not
    imported, since the runner imports this module)."""

    kernel_plan: KernelPlan
    limits: EngineLimits
    device: torch.device
    graphs: GraphRuntime

    @property
    def manager(self) -> GraphManager: ...

    def layer_timer_on(self, inputs: StepInputs, turn: Held) -> StepTimer | None: ...


class DeferredPlans:
    """The measurement after ``runner``'s graphs (see the module docstring);
    ``recaptured``: each graph captured again, and whether the new one stayed."""

    def __init__(self, runner: Measurable) -> None:
        self.runner = runner
        self.recaptured: dict[BatchDescriptor, bool] = {}

    def __call__(self, turn: Held) -> None:
        """The background capture's ``afterwards`` (``turn()``: one unit of work)."""
        runner = self.runner
        manager, plan = runner.manager, runner.kernel_plan
        inputs = StepInputs(runner.limits, runner.device)
        changed = plan.measure_deferred(runner.layer_timer_on(inputs, turn), turn)
        logger.info(
            "ostinato: kernel plans measured (GEMMs %.1f s, layers %.1f s); sizes to capture "
            "again: %s",
            plan.gemm_seconds, plan.layer_seconds, sorted(changed),
        )  # fmt: skip
        plan.compile_measured(inputs, changed)
        keep_new = faster_replay(manager.platform.held_seconds)
        for d in runner.graphs.dispatcher.keys(GraphMode.FULL):
            if d.num_tokens in changed:  # (each part in a turn of its own: ``recapture``)
                self.recaptured[d] = kept = manager.recapture(d, keep_new, turn)
                logger.info("ostinato: %s: the %s graph kept", d, "new" if kept else "rules'")
        plan.keep_rules_at(rules_won(self.recaptured), turn)

    def finish(self) -> None:
        """Waits for the background capture where plans are still to be measured (a
        Ctrl-C stops the wait)."""
        background = self.runner.manager.background
        if background is None or background.done or not self.runner.kernel_plan.deferred:
            return
        logger.warning(
            "ostinato: measuring the kernel plans before closing, for the next start "
            "(once; Ctrl-C skips it)"
        )
        background.wait()

    def summary(self) -> str:
        """``measured plans: 3 graphs captured again, 2 kept`` (empty with none)."""
        if not self.recaptured:
            return ""
        kept = sum(self.recaptured.values())
        return f"measured plans: {len(self.recaptured)} graphs captured again, {kept} kept"


def rules_won(recaptured: dict[BatchDescriptor, bool]) -> frozenset[int]:
    """The sizes where every graph captured again lost to the rules' graph it would have
    replaced (a size whose graphs disagree keeps the measured plans)."""
    sizes = {d.num_tokens for d in recaptured}
    won = {d.num_tokens for d, kept in recaptured.items() if kept}
    return frozenset(sizes - won)


def faster_replay(timer: HeldTimer, rounds: int = 15, replays: int = 1) -> KeepNew:
    """``GraphManager.recapture``'s choice: ``rounds`` alternating rounds of ``replays``
    replays of each graph, each round queued inside a ``held()`` of its own and timed by
    ``timer`` (``Platform.held_seconds``: on CUDA the device's clock, so a host busy with
    other work, as a first start's compile workers keep it, counts only where it delays a
    replay's launch past the spin ahead of it); the new graph stays unless its median is
    slower. By default a round is one replay, so a step beside waits for one replay, not
    five (the 1.5 B shape's five held 5 ms)."""

    def keep_new(old: Callable[[], None], new: Callable[[], None], held: Held) -> bool:
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(rounds):
            for replay, seconds in ((old, times[0]), (new, times[1])):
                seconds.append(timer(replay, replays, held))
        old_s, new_s = statistics.median(times[0]), statistics.median(times[1])
        logger.info(
            "ostinato: a graph on the measured plans replays in %.3f ms, the rules' in "
            "%.3f ms (medians of %d)", new_s * 1e3, old_s * 1e3, rounds,
        )  # fmt: skip
        return new_s <= old_s

    return keep_new
