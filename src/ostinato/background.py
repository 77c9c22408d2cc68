"""Capture in the background: graphs are recorded on a thread while steps already run.

``BackgroundCapture`` captures a plan item by item on a thread of its own. Each item
(its dummy inputs, warm-ups and capture) runs while it holds the manager's turn, the lock
a step holds from writing its inputs to queueing its work, so a capture never writes a
step's inputs and a step never reads a capture's. Where the platform records without
running anything (``Platform.records_apart``: CUDA), a FULL graph's recording lets go of
the turn: the steps run while it records, and wait only for its dummy inputs and
warm-up; with the manager's ``warm_step`` (the step's work on inputs of its own) the
warm-up runs beside them too, and the item holds the turn only to write the dummy
inputs (0.2 ms at most for the 1.5 B shape's 63 graphs on an H200).
Between items the steps run: eagerly for a size whose graph is not ready, replayed once
it is. Sizes that steps asked for are captured before the rest of the plan.

Steps come first. An item holding the whole turn holds it for tens of milliseconds (the
first, with the largest size's warm-ups and the process's first capture, for over half
a second), which a step arriving meanwhile waits out. So the thread starts an item only
when the steps have paused (no step holds the turn, waits for it or released it in the last
``PAUSE_S``), or when a step ran eagerly at a size still to capture (its graph is what
speeds that step up): steps that replay their graphs back to back run at full speed, and
the rest of the plan is captured in their pauses, and under steps that never pause, one
item every ``MAX_WAIT_S`` (so the plan, and the sampling graphs after it, still finish).
Before this, steps and items alternated one to one: on the H200 a served stream got a
token every 40 ms while the 1.5 B shape's 63 graphs were captured. After each item, a
step waiting for the turn gets it before the next item starts.
Items that warm up and record beside the steps (``beside``: they hold the turn for their
dummy inputs only) are paced as units are instead: each once the thread has waited
``UNIT_SPACING`` times the last one's hold (within ``PAUSE_S`` .. ``MAX_WAIT_S``), so
they follow each other closely (one a second took the 1.5 B shape's 63 graphs 82-88 s
under steps that never paused, each holding the turn 0.2 ms).

While it runs, the interpreter switches threads every ``SWITCH_INTERVAL_S`` instead of
every 5 ms: PyTorch releases the GIL around every op, and a step's op that wants it back
would otherwise wait for the capture thread's next switch, up to 5 ms per op (a decode
step of hundreds of ops took seconds while Dynamo traced on the capture thread).

The thread works beside the steps (``ostinato.steps_first``): at its pause points (the
engine's kernel launches) it waits while a step that replays holds the turn.

After the plan (and its epilogue), ``afterwards`` may go on with work that needs the
graphs captured first (the engine measures its kernel plans there and recaptures the
sizes they change). It takes the device and the turn for one unit of work at a time
(``unit()``), as the epilogue's units are taken: when the steps pause, or, under steps
that never pause, after ``UNIT_SPACING`` times the last unit's hold (so short units come
often and long ones rarely: about a tenth of the time held either way).

Last, ``settle`` may run on the thread, without the turn, once all of that has ended
without a stop or a failed item: the engine collects and freezes its heap there, since what
the thread made (graphs, compiled kernels, plans) lives as long as the graphs, and every
later full collection would walk it again.

Guarantees: the thread stops after the item (or unit) in progress when asked (``stop``);
a failure of any item releases every graph of the manager, is logged with its reason and
kept in ``error``, and the steps go on eagerly; a failure of ``afterwards`` is logged
and kept in ``afterwards_error``, and the graphs serve on; ``done`` is set once the plan
and ``afterwards`` are exhausted, stopped or failed, and ``seconds`` then says how long
it took (``capture_seconds``: the plan's part). ``longest_hold`` names the thread's
longest hold of the turn (an item, the epilogue or a unit, with the function that took
the unit), the longest a step could have waited for it; ``summary`` reports it; ``holds``
tallies every hold by kind (the captures, the epilogue, each unit's function).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ostinato import steps_first, switch_interval
from ostinato.batch import BatchDescriptor, CaptureItem
from ostinato.graph import recording_apart
from ostinato.guard import capture_phase
from ostinato.platform.base import Held, exclusive_device, isolated_capture

logger = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0002
PAUSE_S = 0.005  # no step for this long: the steps have paused (e.g. between requests)
MAX_WAIT_S = 1.0  # the longest the thread waits for a pause before it takes an item anyway
# A unit after the capture waits at most this many times its predecessor's hold for a
# pause (within PAUSE_S..MAX_WAIT_S): under steps that never pause, units hold the turn
# about a tenth of the time, so many short units finish as soon as a few long ones did.
UNIT_SPACING = 9.0
# The longest a thread beside the steps waits at one pause point while a step holds the
# turn: longer than a decode step's launch, and a bound should a step ever wait on that
# thread (it then goes on after this, as it would without the pause).
STEP_WAIT_S = 0.05


class Turn:
    """A re-entrant lock held by a step or a capture item, which knows whether a step is
    waiting for it (so the capture thread can hand it over between items), whether the
    steps are running (``steps_active``), and when a step lets go of it (for a thread
    beside the steps that waits meanwhile: ``wait_while_stepping``)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._waiting = 0
        self._held = 0  # a step's holds (re-entrant)
        self._holder = 0  # the thread of those holds (its ident; 0: none)
        self._eager = False  # the step holding the turn runs eagerly (``step_runs_eagerly``)
        self._pausing = 0  # threads in ``wait_while_stepping`` (woken as a step lets go)
        self._changed = threading.Condition()
        self._last_step_end = 0.0  # time.monotonic() when a step last released the turn

    def __enter__(self) -> None:
        self._acquire()
        self._held += 1
        self._holder = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self._held -= 1
        self._last_step_end = time.monotonic()
        if not self._held:
            self._holder, self._eager = 0, False
            self._wake_pausing()
        self._lock.release()

    def _wake_pausing(self) -> None:
        # Without the condition's lock where no thread pauses: taking it at every step
        # slowed a capture thread's hand-over under steps that never pause. No wake-up is
        # lost: a thread counts itself in ``_pausing`` before it reads ``_held`` and
        # ``_eager``, and the step writes them before it reads ``_pausing``.
        if self._pausing:
            with self._changed:
                self._changed.notify_all()

    def step_runs_eagerly(self) -> None:
        """Called by the step holding the turn as it runs eagerly: threads beside the
        steps go on beside it (``wait_while_stepping`` returns) until it lets go. Why:
        an eager step holds the turn for milliseconds, and their work (its size's graph)
        is what speeds it up; waiting out every eager step kept an H200's 1.5 B graphs
        from being ready for 52 s instead of 14-19, the steps eager all that time."""
        self._eager = True
        self._wake_pausing()

    def wait_while_stepping(self) -> None:
        """Returns once no step on another thread holds the turn (at once on the thread
        that holds it, and while the step that does runs eagerly), or after
        ``STEP_WAIT_S`` (``ostinato.steps_first``)."""
        me = threading.get_ident()

        def passes() -> bool:
            return not self._held or self._holder == me or self._eager

        with self._changed:
            self._pausing += 1
            try:
                self._changed.wait_for(passes, STEP_WAIT_S)
            finally:
                self._pausing -= 1

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """The capture's hold of the turn (``with turn:`` is a step's)."""
        self._acquire()
        try:
            yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Inside ``capturing()``, on its thread: the steps may take the turn for the
        block, which then waits for the turn back."""
        self._lock.release()
        try:
            yield
        finally:
            self._acquire()

    def _acquire(self) -> None:
        with self._changed:
            self._waiting += 1
        self._lock.acquire()
        with self._changed:
            self._waiting -= 1
            self._changed.notify_all()

    def steps_active(self, pause_s: float) -> bool:
        """Whether a step holds the turn, waits for it, or released it less than
        ``pause_s`` seconds ago."""
        recent = time.monotonic() - self._last_step_end < pause_s
        return self._held > 0 or self._waiting > 0 or recent

    def hand_over(self, timeout: float) -> None:
        """Waits (at most ``timeout``) until no thread is waiting for the turn."""
        with self._changed:
            self._changed.wait_for(lambda: self._waiting == 0, timeout)


class CaptureStopped(Exception):
    """Raised by ``BackgroundCapture.unit()`` once the thread was asked to stop."""


@dataclass(frozen=True)
class Hold:
    """The thread's longest hold of the step turn: how long, and over what (an item's
    descriptor, the epilogue, a unit of the work afterwards). A step that arrived as it
    began waited that long."""

    seconds: float
    what: str


@dataclass
class HoldTally:
    """The holds of one kind (``BackgroundCapture.holds``): how many, their seconds in
    all, the longest."""

    count: int = 0
    seconds: float = 0.0
    longest: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds
        self.longest = max(self.longest, seconds)


# Work on the thread in units (the epilogue, ``afterwards``), given a ``Held`` that holds
# the step turn and the device for one unit: what it does inside ``with unit():`` holds
# them, what it does outside runs beside the steps.
InUnits = Callable[[Held], None]


def _paced_wait(hold_s: float) -> float:
    """The longest wait for a pause after a paced hold of ``hold_s`` seconds:
    ``UNIT_SPACING`` times it, within ``PAUSE_S`` .. ``MAX_WAIT_S``."""
    return min(MAX_WAIT_S, max(PAUSE_S, UNIT_SPACING * hold_s))


def run_settle(settle: Callable[[], None] | None) -> None:
    """Runs ``settle`` (if any) holding the device: a collection inside it must not land
    in another thread's capture, which pauses the collector for that reason. Its failure
    is logged, and nothing else: the graphs serve on."""
    if settle is None:
        return
    try:
        with exclusive_device():
            settle()
    except Exception as exc:
        logger.warning("ostinato: settling after the capture failed: %s", exc)


class BackgroundCapture:
    """The capture thread of one ``GraphManager`` (``GraphManager.capture_in_background``).

    ``capture_one(item, apart)`` captures one item (raising on failure), holding the
    turn but inside ``with apart():``, where it only records (``Platform.records_apart``;
    the steps may run meanwhile); ``release()`` destroys
    every graph; ``turn`` is the manager's step lock; ``prologue``, if given, runs on the
    thread first, without the turn (the engine compiles its model there, on scratch
    inputs of its own); ``epilogue``, if given, runs on the thread once every item is
    captured (not after a stop), before ``done`` is set, and fails as an item does: it
    holds the turn only inside each ``unit()`` it is given, paced as the units after it
    are (the engine compiles its sampling graphs' kernels outside them, beside the
    steps, then captures each size's graphs, which read the step graphs' outputs, in a
    unit of its own: a step waits for one size, not for all); ``afterwards``, if given,
    runs after it (module docstring); ``beside``: ``capture_one`` warms up and records
    beside the steps, its hold of the turn brief, so items are paced as units are
    (module docstring); ``settle``, if given, runs last, before ``done`` is set (module
    docstring; a failure of it is logged and nothing else). The thread runs from
    ``start()``.
    """

    def __init__(
        self,
        plan: list[CaptureItem],
        capture_one: Callable[[CaptureItem, Held], None],
        release: Callable[[], None],
        turn: Turn,
        prologue: Callable[[], None] | None = None,
        epilogue: InUnits | None = None,
        afterwards: InUnits | None = None,
        beside: bool = False,
        settle: Callable[[], None] | None = None,
    ) -> None:
        self.total = len(plan)
        self._settle = settle
        self._beside = beside
        self.captured = 0
        self.error: BaseException | None = None
        self.afterwards_error: Exception | None = None
        self.seconds: float | None = None
        self.capture_seconds: float | None = None  # the plan and epilogue alone
        self.longest_hold: Hold | None = None
        self.holds: dict[str, HoldTally] = {}  # by kind: "captures", "the epilogue", a unit's
        self._unit_wait = MAX_WAIT_S  # (``unit``'s wait for a pause: see UNIT_SPACING)
        self._apart_s = 0.0  # seconds spent inside ``_apart`` (not holds of the turn)
        self._last_hold = 0.0  # the seconds of the last hold ``_held`` timed
        self._epilogue_units = 0
        self._afterwards = afterwards
        self._pending = list(plan)
        self._wanted: dict[BatchDescriptor, None] = {}  # ordered: first asked, first captured
        self._capture_one, self._release, self._turn = capture_one, release, turn
        self._prologue, self._epilogue = prologue, epilogue
        self._stop = threading.Event()
        self._done = threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="ostinato-capture", daemon=True)

    def start(self) -> BackgroundCapture:
        """Starts the thread (once; its owner keeps this object first, so that a step
        asking for the turn meanwhile finds it); returns this object."""
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        """True once the thread has finished (every item captured, stopped or failed)."""
        return self._done.is_set()

    @property
    def finished(self) -> bool:
        """True once ``done`` without an error: every graph captured (unless stopped), the
        thread touching nothing more."""
        return self.done and self.error is None

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until ``done`` (at most ``timeout`` seconds); returns ``done``."""
        return self._done.wait(timeout)

    def want(self, descriptor: BatchDescriptor) -> None:
        """Asks for ``descriptor``'s item before the rest (a step runs it eagerly), and
        lets this thread go on beside that step (``Turn.step_runs_eagerly``). Called
        with the turn held."""
        self._wanted.setdefault(descriptor)
        self._turn.step_runs_eagerly()

    def stop(self, timeout: float | None = None) -> bool:
        """Stops after the item in progress; returns True if the thread has ended (from
        the thread itself, only asks)."""
        self._stop.set()
        if threading.current_thread() is self._thread:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def summary(self) -> str:
        """One line: how many graphs are ready, the error if capture failed, and once done
        the longest a step waited for the thread (``longest_hold``)."""
        if self.error is not None:
            return f"background capture failed, steps run eagerly: {self.error}"
        if self.capture_seconds is None:
            return f"graphs capturing in the background: {self.captured} of {self.total} ready"
        ready = f"graphs ready in {self.capture_seconds:.1f} s ({self.captured} of {self.total})"
        if self._afterwards is None:
            return ready + self._longest()
        if not self.done:
            return f"{ready}; measuring after them"
        if self.afterwards_error is not None:
            return f"{ready}; what followed them failed: {self.afterwards_error}"
        return f"{ready}; done after {self.seconds:.1f} s{self._longest()}"

    def _longest(self) -> str:
        """``, steps could wait up to 3.2 ms (the epilogue)`` (ms: holds are short);
        empty before any hold."""
        hold = self.longest_hold
        if hold is None:
            return ""
        return f", steps could wait up to {1e3 * hold.seconds:.1f} ms ({hold.what})"

    def _next(self) -> CaptureItem | None:
        for d in list(self._wanted):
            del self._wanted[d]
            for i, item in enumerate(self._pending):
                if item.descriptor == d:
                    return self._pending.pop(i)
        return self._pending.pop(0) if self._pending else None

    def _run(self) -> None:
        switch_interval.lower(SWITCH_INTERVAL_S)
        try:
            with torch.inference_mode(), isolated_capture(), steps_first.beside(self._turn):
                if self._prologue is not None:
                    self._prologue()
                    logger.info("ostinato: background prologue done after %.1f s", self._since())
                # The collector runs on (each capture pauses it): the phase lasts as long as
                # the start, beside the steps (``capture_phase``).
                with capture_phase(collect=False, pause_collector=False):
                    self._capture_all()
                    self.capture_seconds = self._since()
                    if self._afterwards is not None and not self._stop.is_set():
                        logger.info("ostinato: %s", self.summary())
                    self._after()
            if not self._stop.is_set():
                run_settle(self._settle)
        except BaseException as exc:  # the thread's end: nothing above it would see it
            self.error = exc
            with self._turn.capturing():
                self._release()
            logger.warning("ostinato: background capture failed; steps run eagerly: %s", exc)
        finally:
            switch_interval.restore(SWITCH_INTERVAL_S)
            self.seconds = time.perf_counter() - self._start
            self._done.set()
        if self.error is None and not self._stop.is_set():
            logger.info("ostinato: %s", self.summary())

    def _since(self) -> float:
        return time.perf_counter() - self._start

    def _after(self) -> None:
        """Runs ``afterwards`` once the plan is captured (not after a stop); its failure
        is logged and kept, the graphs untouched."""
        if self._afterwards is None or self._stop.is_set():
            return
        try:
            self._afterwards(self.unit)
        except CaptureStopped:
            pass
        except Exception as exc:
            self.afterwards_error = exc
            logger.warning("ostinato: after the capture: %s; the graphs serve on", exc)

    def unit(self) -> contextlib.AbstractContextManager[None]:
        """For ``afterwards``, on the thread: holds the device and the step turn for one
        unit of work (``_holding``), named by the function that asked for it (in
        ``longest_hold`` and ``holds``); raises ``CaptureStopped`` once the thread is asked
        to stop."""
        caller = sys._getframe(1)
        module = caller.f_globals.get("__name__", "?").rpartition(".")[2]
        site = f"{module}.{caller.f_code.co_name}"
        return self._holding(f"a unit after the capture: {site}", paced=True, kind=site)

    @contextlib.contextmanager
    def _holding(self, what: str, paced: bool = False, kind: str | None = None) -> Iterator[None]:
        """Holds the device and the step turn for ``what``, taken as an item is (when the
        steps pause; ``paced``: after ``UNIT_SPACING`` times the last paced hold at most),
        timed (``_held``), and hands the turn over after it; raises ``CaptureStopped``
        once the thread is asked to stop."""
        max_wait = self._unit_wait if paced else MAX_WAIT_S
        while True:
            since = self._await_pause(max_wait)
            if self._stop.is_set():
                raise CaptureStopped("the background capture was stopped")
            with exclusive_device(), self._turn.capturing():
                if self._may_start(since, max_wait):
                    with self._held(what, kind or what):
                        yield
                    if paced:
                        self._unit_wait = _paced_wait(self._last_hold)
                    break
        self._turn.hand_over(timeout=1.0)

    @contextlib.contextmanager
    def _held(self, what: str, kind: str) -> Iterator[None]:
        """Times a hold of the turn, less the time its item spent ``_apart`` (the parts
        before and after summed): tallied under ``kind``, kept in ``longest_hold`` (as
        ``what``) where it is the longest."""
        start, apart = time.perf_counter(), self._apart_s
        try:
            yield
        finally:
            seconds = time.perf_counter() - start - (self._apart_s - apart)
            self._last_hold = seconds
            self.holds.setdefault(kind, HoldTally()).add(seconds)
            if self.longest_hold is None or seconds > self.longest_hold.seconds:
                self.longest_hold = Hold(seconds, what)

    def _await_pause(self, max_wait: float = MAX_WAIT_S) -> float:
        """Waits while the steps run (module docstring), unless a step wants a size still
        to capture, ``max_wait`` passed, or the thread is asked to stop; returns when it
        began to wait."""
        since = time.monotonic()
        while not self._may_start(since, max_wait) and not self._stop.is_set():
            self._stop.wait(PAUSE_S / 5)
        return since

    def _may_start(self, since: float, max_wait: float = MAX_WAIT_S) -> bool:
        """Whether an item may start, the thread having waited for a pause since
        ``since`` (for at most ``max_wait``)."""
        waited = time.monotonic() - since >= max_wait
        return waited or self._wanted_pending() or not self._turn.steps_active(PAUSE_S)

    def _wanted_pending(self) -> bool:
        wanted = self._wanted  # (steps add to it, holding the turn; read here without it)
        return any(item.descriptor in wanted for item in self._pending)

    def _capture_all(self) -> None:
        wait = MAX_WAIT_S  # (for a pause, at most; items ``beside``: paced by their holds)
        while not self._stop.is_set():
            since = self._await_pause(wait)
            # The process's device first, then the turn: an item waiting while another
            # engine is built does not hold this engine's steps back.
            with exclusive_device(), self._turn.capturing():
                if not self._may_start(since, wait):
                    continue  # a step came while the turn was taken: it goes first
                item = self._next()
                if item is not None:
                    with self._held(f"the capture of {item.descriptor}", "captures"):
                        self._capture_one(item, self._apart)
                    self.captured += 1
                    if self._beside:
                        wait = _paced_wait(self._last_hold)
            if item is None:
                self._end_plan()
                return
            self._turn.hand_over(timeout=1.0)

    @contextlib.contextmanager
    def _apart(self) -> Iterator[None]:
        """Inside an item: the turn released while the item only records (the steps may
        run meanwhile), taken back after (waiting for a step that took it); the time
        is no hold."""
        start = time.perf_counter()
        try:
            with self._turn.released():
                yield
        finally:
            self._apart_s += time.perf_counter() - start

    def _end_plan(self) -> None:
        """Once every item is captured: the epilogue, holding the turn for each of its
        units (``_epilogue_unit``)."""
        if self._epilogue is None or self._stop.is_set():
            return
        try:
            self._epilogue(self._epilogue_unit)
        except CaptureStopped:
            pass  # (asked to stop while it waited for the steps to pause)

    def _epilogue_unit(self) -> contextlib.AbstractContextManager[None]:
        """For the epilogue: holds the device and the turn for one unit of it, taken as
        a unit after it is (when the steps pause, or after ``UNIT_SPACING`` times the
        last paced hold: the engine's sampling graphs hold it a few ms each, and 21 of
        them waiting ``MAX_WAIT_S`` each kept the graphs from being ready for 20 s
        under steps that never paused), tallied as "the epilogue" (named by its number
        in ``longest_hold``); raises ``CaptureStopped`` once the thread is asked to
        stop."""
        self._epilogue_units += 1
        what = f"the epilogue's unit {self._epilogue_units}"
        return self._epilogue_held(what)

    @contextlib.contextmanager
    def _epilogue_held(self, what: str) -> Iterator[None]:
        """An epilogue unit's hold, inside which a capture that runs nothing may record
        with the turn let go (``graph.recorded_apart``: the sampling graphs')."""
        with self._holding(what, paced=True, kind="the epilogue"), recording_apart(self._apart):
            yield
