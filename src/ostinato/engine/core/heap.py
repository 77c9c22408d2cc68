"""The cyclic garbage collector around a start: no collection while a process starts (its
imports, the engine's build up to its capture, the server's modules), then one collection
and what is left frozen (``gc.freeze``: moved into the permanent generation, which no
later collection walks). Imports nothing but the standard library, so a command can enter
``quiet_start`` before it imports torch.

Never around a graph capture: the collector's switch is process-wide, and each capture
turns it off and back on by itself (``platform.base.paused_collection``); a block ending
while a background capture runs would turn it on in the middle of one.

Why: what a start makes lives as long as the process, and each collection on the way walks
what it has made so far again. On the development machine a SmolLM2 ``generate`` ran three
full collections while it imported (127 ms) and 433 younger ones (50 ms) over its run; the
serving process (210 thousand objects, torch among its imports), not frozen, ran a full
collection under load that held the event loop, and every stream, for 116-123 ms
(benchmarks/RESULTS.md). Frozen, a collection walks only what is new.
"""

from __future__ import annotations

import contextlib
import gc
import pickle
import time
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def quiet_start() -> Iterator[None]:
    """No cyclic collection inside the block. Leaving it normally: one collection (the
    block's garbage goes, none of it is frozen) and the heap frozen (``freeze_heap``);
    leaving it by an exception: no freeze. Either way the collector is then on or off as
    it was on entry (so an inner block leaves an outer one's pause in place)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        freeze_heap()
    finally:
        if was_enabled:
            gc.enable()


def freeze_heap() -> None:
    """Collects once, then moves every object left into the collector's permanent
    generation, which no later collection walks (``EngineParts.release`` moves them back).
    The collection first, so that no garbage is frozen.

    Why: what a start makes (imported modules, the model and its parameters' wrappers,
    compiled code) lives as long as the engine, and each full collection walked all of it
    again: 90-120 ms with the GIL held on an H200 host, every step waiting, against 3-17
    ms frozen (benchmarks/RESULTS.md)."""
    gc.collect()
    gc.freeze()


# How long an asked freeze waits for the engine to be idle before it runs between steps.
OVERDUE_S = 30.0


class IdleFreeze:
    """``freeze_heap`` asked for on one thread (``ask``: a background start's or a staged
    upgrade's, as it ends) and run on the engine's while no request is running
    (``at_idle``: before a run of steps begins and after it ends), or between two steps
    once ``OVERDUE_S`` seconds have passed since the ask (``between_steps``). Runs once
    per ask.

    Why: the freeze's one collection holds the interpreter's lock as long as it walks what
    the start made; run on the capture thread as it ended, it held a step between two
    tokens (14 ms on an H200 host, the 1.5 B shape's first start: benchmarks/RESULTS.md).
    Idle, it delays no token of a stream; the fallback bounds how long a never-idle
    engine's full collections walk what the start made."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._asked: float | None = None

    def ask(self) -> None:
        """Asks for a freeze (from any thread); a second ask before it runs is the same."""
        if self._asked is None:
            self._asked = self._clock()

    @property
    def asked(self) -> bool:
        """Whether a freeze is asked for and not yet run."""
        return self._asked is not None

    def at_idle(self) -> bool:
        """On the engine's thread, no request running: runs the freeze asked for, if one
        is; returns whether it ran."""
        return self._run_asked()

    def between_steps(self) -> None:
        """On the engine's thread between two steps: runs the freeze asked for once it is
        ``OVERDUE_S`` old."""
        asked = self._asked
        if asked is not None and self._clock() - asked > OVERDUE_S:
            self._run_asked()

    def _run_asked(self) -> bool:
        """The freeze, where one is asked for (the ask cleared first: an ask from another
        thread during the freeze is a new one)."""
        if self._asked is None:
            return False
        self._asked = None
        freeze_heap()
        return True


def call_unpickled(payload: bytes, *args: Any) -> None:
    """Unpickles ``payload``, a callable and its leading arguments, inside ``quiet_start``
    (so the imports its unpickling brings run without collections, and their heap is
    frozen), then calls it with those arguments and then ``args``.

    Why: a spawned process's target unpickles before any code of ours runs, importing
    torch and the engine's modules with the collector on (three full collections on the
    development machine); handing the target over as bytes to this light module moves
    those imports inside the block. ``args`` are what must travel as the process's own
    arguments (pipes, shared values: they pickle only while a process is spawned)."""
    with quiet_start():
        fn, lead = pickle.loads(payload)
    fn(*lead, *args)
