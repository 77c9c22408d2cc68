"""The interpreter's thread switch interval, lowered while a thread that waits on the
device (or on another process) shares the interpreter with busy ones.

A thread woken by its wait takes the interpreter lock only at the running thread's next
switch, up to ``sys.getswitchinterval()`` later (5 ms by default): a background capture
held steps that long, and an engine's reader delivered tokens that late. Each such thread
holds a lower interval while it runs. Holders overlap (a capture thread beside a serving
loop, several engines in one server), so they are counted here: the interval is the
lowest any holder asked for, and the one from before the first holder comes back when the
last lets go, whatever order they end in. Setting it by hand while a holder runs is
undone when the holders change.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_held: list[float] = []  # every holder's interval, in seconds
_before = 0.0  # the interval before the first holder


def lower(seconds: float) -> None:
    """Holds the interval at ``seconds`` at most until a matching ``restore``."""
    global _before
    if not seconds > 0:
        raise ValueError(f"switch interval: expected seconds > 0, got {seconds!r}")
    with _lock:
        if not _held:
            _before = sys.getswitchinterval()
        _held.append(seconds)
        sys.setswitchinterval(min(_before, *_held))


def restore(seconds: float) -> None:
    """Lets go of one ``lower(seconds)``: the interval becomes the lowest still held, or
    the one from before the first holder when none is."""
    with _lock:
        if seconds not in _held:
            raise RuntimeError(f"switch interval: restore({seconds}) without its lower")
        _held.remove(seconds)
        sys.setswitchinterval(min(_before, *_held) if _held else _before)


@contextlib.contextmanager
def lowered(seconds: float) -> Iterator[None]:
    """``lower(seconds)`` for the block, ``restore`` on leaving it however it ends."""
    lower(seconds)
    try:
        yield
    finally:
        restore(seconds)
