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
from collections.abc import Iterator
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
