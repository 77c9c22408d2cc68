"""Staged graphs: serve at once from graphs that are quick to make, and upgrade, bucket by
bucket, to graphs that are slow to make where they measure faster.

``StagedRuntime(first, build_upgrade)`` steps through ``first`` (a ``GraphRuntime`` whose
graphs are captured already, e.g. FULL graphs of eager kernels) from its first step. A
thread meanwhile calls ``build_upgrade()`` (which may compile for minutes: Inductor
pieces, compiled kernels) and, for each bucket of the upgrade's capture plan, the
buckets the steps used most first: captures it, then times it against the first stage's
bucket for the same steps on the same inputs (the caller's ``prepare`` writes them once;
each stage replays ``repeats`` times, alternately) and routes those steps to the upgrade
only where its median is faster by ``margin``. Every decision is kept in ``decisions``.

A route is a pair of buckets, the first stage's and the upgrade's for the same steps: the
two stages may key a step differently (FULL graphs serve a uniform decode from a mixed
batch's graph, FULL_AND_PIECEWISE from a decode graph of its own), so each of the
upgrade's buckets is measured against the first stage's bucket for the steps it serves,
and only steps that dispatch to both move.

Guarantees:

- Routing changes between steps only: the thread changes the table, captures and times
  only while it holds the step's turn (``stepping()``, held by a step from its
  ``dispatch`` to reading its outputs), which it hands back after every capture and every
  timed pair of replays. So a waiting step is delayed by at most one of those.
- A bucket moves to the upgrade only if it was measured faster there.
- The first stage keeps serving whatever happens to the upgrade: a failure (compile,
  capture, measurement) or an upgrade whose captures exceed ``memory_budget`` bytes
  (``CaptureReport.pool_bytes``) routes every bucket back to the first stage, releases
  the upgrade's graphs and logs a warning naming why; ``error`` keeps the failure.
- ``release()`` stops the thread after the item in progress and releases both stages.
- ``settle``, if given, runs once, last, before ``done`` is set, holding the device and
  not the turn, where every bucket was decided without a failure or a stop (a failure of
  it is logged, and nothing else): on the thread, or with ``on_steps`` on the thread of
  the last advance. The engine collects and freezes its heap there, as after a
  background capture (what the upgrade made lives as long as its graphs).

With ``on_steps``, the thread only builds the upgrade (``build_upgrade`` may run it
eagerly, to compile it, but captures nothing): its captures and measurements happen on
the steps' thread, one bucket per ``advance()`` (a step calls it before its own), and
``wait`` advances through the rest; each advance holds ``device_lock`` (shared with the
caller's other device work that must not overlap a capture). That is for callers that
cannot keep their own device work out of a capture in progress on another thread (a
device-wide synchronize, the default CUDA generator's offsets): ``graphed``, whose
caller's code runs between its calls.

Build the upgrade in a graph pool of its own (``pool=platform.graph_pool_handle()``), so
that releasing it gives its memory back without touching the first stage's graphs, or in
the first stage's pool (as ``graphed`` does) where a lower peak matters more than that.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ostinato import steps_first, switch_interval
from ostinato.background import SWITCH_INTERVAL_S, Turn, run_settle
from ostinato.batch import BatchDescriptor, CaptureItem
from ostinato.dispatcher import Dispatch
from ostinato.guard import capture_phase
from ostinato.manager import Outputs
from ostinato.platform.base import exclusive_device, isolated_capture
from ostinato.runtime import GraphRuntime

logger = logging.getLogger(__name__)

# Times one run of a stage: (runtime, dispatch, rows, attention metadata) -> seconds
Timer = Callable[[GraphRuntime, Dispatch, int, Any], float]


class DeviceLock(Protocol):
    """A lock over device work that must not overlap a capture (``threading.RLock``)."""

    def acquire(self, blocking: bool = True) -> bool: ...

    def release(self) -> None: ...


# The buckets of one kind of step: the first stage's, the upgrade's
Route = tuple[BatchDescriptor, BatchDescriptor]
# A kind of step as the steps asked for it: the first stage's bucket, uniform decode, LoRA
Asked = tuple[BatchDescriptor, bool, bool]


@dataclass(frozen=True, slots=True)
class UpgradeDispatch(Dispatch):
    """A step's dispatch on the upgrade's graphs: what ``StagedRuntime.dispatch`` returns
    for a step whose route moved, and ``run`` runs there."""


@dataclass(frozen=True)
class Decision:
    """What the measurement of one of the upgrade's buckets (``descriptor``) found against
    the first stage's bucket for the same steps (``first``): each one's median seconds
    per step, and whether those steps moved to the upgrade."""

    descriptor: BatchDescriptor
    first: BatchDescriptor
    first_s: float
    upgrade_s: float
    upgraded: bool


def wall_timer(runtime: GraphRuntime, dispatch: Dispatch, rows: int, attn_metadata: Any) -> float:
    """Seconds of one ``runtime`` step, the device synchronized before and after."""
    platform = runtime.manager.platform
    platform.synchronize()
    start = time.perf_counter()
    runtime.manager.run(dispatch, rows, attn_metadata, record=False)
    platform.synchronize()
    return time.perf_counter() - start


class StagedRuntime:
    """Steps on ``first`` while an upgrade is built, captured and measured on a thread
    (see the module docstring). ``prepare(descriptor)`` writes inputs for a step of that
    bucket (a ``GraphManager``'s ``prepare``; the upgrade's is used when None)."""

    def __init__(
        self,
        first: GraphRuntime,
        build_upgrade: Callable[[], GraphRuntime],
        *,
        prepare: Callable[[BatchDescriptor], Any] | None = None,
        repeats: int = 5,
        margin: float = 0.02,
        memory_budget: int | None = None,
        timer: Timer | None = None,
        on_steps: bool = False,
        device_lock: DeviceLock | None = None,
        settle: Callable[[], None] | None = None,
    ) -> None:
        if repeats < 1 or not 0 <= margin < 1:
            raise ValueError(
                f"StagedRuntime: repeats >= 1 and 0 <= margin < 1, got {repeats}, {margin}"
            )
        if memory_budget is not None and memory_budget < 0:
            raise ValueError(f"StagedRuntime: memory_budget >= 0 bytes, got {memory_budget}")
        self.first = first
        self.upgrade: GraphRuntime | None = None
        self.decisions: dict[BatchDescriptor, Decision] = {}
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self._build, self._prepare, self._timer = build_upgrade, prepare, timer
        self._repeats, self._margin, self._budget = repeats, margin, memory_budget
        self._on_steps = on_steps
        self._device_lock = device_lock  # (held by advance)
        self._settle = settle
        self._pending: list[CaptureItem] = []  # on_steps: the upgrade's buckets to come
        self._moved: dict[Route, UpgradeDispatch] = {}  # replaced whole, never changed
        self._used: Counter[Asked] = Counter()
        self._turn = Turn()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="ostinato-upgrade", daemon=True)
        self._thread.start()

    # -- the steps' side

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        """The step's turn: hold it from writing a step's inputs until its outputs are
        read, as with ``GraphManager.stepping``."""
        return self._turn

    def dispatch(
        self, num_tokens: int, uniform_decode: bool = False, has_lora: bool = False
    ) -> Dispatch:
        """The step's dispatch on the stage its route uses now: the upgrade's (an
        ``UpgradeDispatch``, with the upgrade's descriptor) where it moved, else the first
        stage's. Call it, ``run`` it and read its outputs inside one ``stepping()``: the
        stage cannot change in between."""
        first = self.first.dispatch(num_tokens, uniform_decode, has_lora)
        self._used[first.descriptor, uniform_decode, has_lora] += 1
        upgrade = self.upgrade
        if not self._moved or upgrade is None:
            return first
        route = (
            first.descriptor,
            upgrade.dispatch(num_tokens, uniform_decode, has_lora).descriptor,
        )
        return self._moved.get(route, first)

    def routes(self, dispatch: Dispatch) -> bool:
        """Whether ``dispatch`` (from ``dispatch``) runs on the upgrade."""
        return isinstance(dispatch, UpgradeDispatch)

    def run(self, dispatch: Dispatch, num_tokens: int, attn_metadata: Any = None) -> Outputs:
        """Runs the step (``GraphManager.run``) on the stage ``dispatch`` names."""
        if not isinstance(dispatch, UpgradeDispatch):
            return self.first.manager.run(dispatch, num_tokens, attn_metadata)
        if self.upgrade is None:
            raise RuntimeError(
                f"StagedRuntime.run: {dispatch} names the upgrade, which has been dropped "
                "since it was dispatched; dispatch and run inside one stepping()"
            )
        return self.upgrade.manager.run(dispatch, num_tokens, attn_metadata)

    @property
    def upgraded(self) -> frozenset[BatchDescriptor]:
        """The upgrade's buckets that steps run on."""
        return frozenset(d.descriptor for d in self._moved.values())

    @property
    def done(self) -> bool:
        """True once the thread has ended (every bucket decided, stopped or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until ``done`` (at most ``timeout`` seconds for the thread); returns
        ``done``. With ``on_steps`` the rest of the buckets are captured and measured
        here, on the caller's thread, once the thread has built the upgrade."""
        if not self._on_steps:
            return self._done.wait(timeout)
        self._thread.join(timeout)
        # (advance takes the device lock, then the turn, as a step's advance does: taking
        # the turn first here would deadlock with a step holding the lock)
        while not self._thread.is_alive() and not self.done and not self._stop.is_set():
            self.advance(wait=True)
        return self.done

    def advance(self, wait: bool = False) -> None:
        """With ``on_steps``, once the upgrade is built: captures the next of its buckets
        (the one steps used most) and measures it, on this thread; nothing otherwise, nor
        while another holds ``device_lock`` unless ``wait``. A failure ends the upgrade
        as on the thread (the first stage serves on)."""
        if not self._on_steps or self.done or self._stop.is_set() or self._thread.is_alive():
            return
        lock = self._device_lock
        if lock is not None and not lock.acquire(blocking=wait):
            return  # (busy: a later step advances)
        try:
            self._advance()
        finally:
            if lock is not None:
                lock.release()

    def _advance(self) -> None:
        with self._turn:
            try:
                upgrade = self.upgrade
                if upgrade is None or not self._pending:
                    raise RuntimeError(self.error or "the upgrade was not built")
                item = self._by_use(upgrade, self._pending).pop(0)
                self._pending.remove(item)
                with torch.inference_mode(), capture_phase(collect=False):
                    upgrade.manager.capture_item(item)
                    self._within_budget(upgrade)
                    self._measure(upgrade, item.descriptor)
            except BaseException as exc:
                self._fail(exc)
                if not isinstance(exc, Exception):  # (a Ctrl-C stays the caller's)
                    self._finish()
                    raise
            ended = not self._pending
        if ended:
            self._finish()  # (without the turn: ``settle`` runs there)

    def summary(self) -> str:
        """One line: how far the upgrade is, or why it stopped."""
        if self.error is not None:
            return f"graph upgrade stopped, the first stage serves: {self.error}"
        moved = len(self._moved)
        if self.seconds is None:
            return (
                f"graph upgrade in progress: {len(self.decisions)} buckets measured, {moved} moved"
            )
        return (
            f"graph upgrade done in {self.seconds:.1f} s: {moved} of {len(self.decisions)} "
            "buckets measured faster and moved"
        )

    def release(self, timeout: float | None = None) -> None:
        """Stops the thread after its item in progress, then releases both stages."""
        self._stop.set()
        self._thread.join(timeout)
        with self._turn:
            self._drop_upgrade()
            self.first.manager.release()

    # -- the thread's side

    def _run(self) -> None:
        switch_interval.lower(SWITCH_INTERVAL_S)
        try:
            with torch.inference_mode(), isolated_capture(), steps_first.beside(self._turn):
                upgrade = self._build()
                with self._turn:
                    self.upgrade = upgrade
                    self._pending = upgrade.manager.capture_plan()
                if self._on_steps:
                    return  # (captured and measured by the steps: advance)
                with capture_phase(collect=False, pause_collector=False):  # (beside calls)
                    self._upgrade_all(upgrade)
        except BaseException as exc:  # the thread's end: nothing above it would see it
            self._fail(exc)
        finally:
            switch_interval.restore(SWITCH_INTERVAL_S)
        if not self._on_steps or self.error is not None or not self._pending:
            self._finish()

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        with self._turn:
            self._pending = []
            self._drop_upgrade()

    def _finish(self) -> None:
        if self.error is None and not self._stop.is_set():
            run_settle(self._settle)
        self.seconds = time.perf_counter() - self._start  # (the summary says done now)
        if self.error is None:
            logger.info("ostinato: %s", self.summary())
        else:
            logger.warning("ostinato: %s", self.summary(), exc_info=self.error)
        self._done.set()  # (after the log: a waiter may read it)

    def _by_use(self, upgrade: GraphRuntime, items: list[CaptureItem]) -> list[CaptureItem]:
        """``items``, the buckets steps used most first (sorted again after each item,
        so a size that comes into use moves up)."""
        used: Counter[BatchDescriptor] = Counter()
        for (first, uniform, lora), count in self._used.copy().items():  # (steps count on)
            used[upgrade.dispatch(first.num_tokens, uniform, lora).descriptor] += count
        return sorted(items, key=lambda item: -used[item.descriptor])

    def _upgrade_all(self, upgrade: GraphRuntime) -> None:
        pending = self._by_use(upgrade, upgrade.manager.capture_plan())
        while pending and not self._stop.is_set():
            item = pending.pop(0)
            # The process's device before the turn, as background capture takes them: a
            # wait for another engine's build does not hold the steps back.
            with exclusive_device(), self._turn:
                upgrade.manager.capture_item(item)
            self._within_budget(upgrade)
            self._turn.hand_over(timeout=1.0)
            self._measure(upgrade, item.descriptor)
            pending = self._by_use(upgrade, pending)

    def _within_budget(self, upgrade: GraphRuntime) -> None:
        held = upgrade.manager.report.pool_bytes
        if self._budget is not None and held > self._budget:
            raise MemoryError(
                f"the upgrade's graphs hold {held / 2**20:.1f} MiB, over the "
                f"{self._budget / 2**20:.1f} MiB planned for them; raise the budget or "
                "capture fewer sizes"
            )

    def _measure(self, upgrade: GraphRuntime, d: BatchDescriptor) -> None:
        """Times the upgrade's bucket ``d`` and the first stage's for the same steps on the
        same inputs, one pair of runs per turn (on the thread; all in the step's turn
        with ``on_steps``); moves those steps to the upgrade where its median is faster
        by the margin."""
        first_d = self.first.dispatch(d.num_tokens, d.uniform_decode, d.has_lora)
        upgrade_d = upgrade.dispatch(d.num_tokens, d.uniform_decode, d.has_lora)
        if upgrade_d.descriptor != d or first_d.padded_tokens != d.num_tokens:
            return  # no step dispatches to it, or the two stages pad this size differently
        prepare = self._prepare or upgrade.manager.prepare
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(self._repeats):
            if self._stop.is_set():
                return
            with self._turn:
                meta = prepare(d) if prepare is not None else None
                timer = self._timer or wall_timer  # (looked up here: a test may replace it)
                times[0].append(timer(self.first, first_d, d.num_tokens, meta))
                times[1].append(timer(upgrade, upgrade_d, d.num_tokens, meta))
            if not self._on_steps:  # (a step holds the turn through its advance)
                self._turn.hand_over(timeout=1.0)
        first_s, upgrade_s = statistics.median(times[0]), statistics.median(times[1])
        faster = upgrade_s < first_s * (1 - self._margin)
        with self._turn:
            self.decisions[d] = Decision(d, first_d.descriptor, first_s, upgrade_s, faster)
            if faster:
                moved = UpgradeDispatch(upgrade_d.mode, d)
                self._moved = {**self._moved, (first_d.descriptor, d): moved}

    def _drop_upgrade(self) -> None:
        """Routes every step back to the first stage and releases the upgrade (called
        with the turn held)."""
        self._moved = {}
        if self.upgrade is not None:
            self.upgrade.manager.release()
            self.upgrade = None
