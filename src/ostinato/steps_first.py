"""Steps first: a thread working beside the steps stands aside while a step launches.

Python runs one thread at a time. A step's launch lets the interpreter go around each
PyTorch call and takes it back after; while another thread runs Python (a background
capture warming up, recording or timing kernels), each take-back waits for that
thread's next switch (``sys.getswitchinterval()``). On an H200 a 1.5 B shape's decode
step took 2-12 ms to launch instead of under one while the engine measured its kernel
plans beside it (benchmarks/RESULTS.md).

So a thread that works beside the steps says so (``beside(turn)``, naming the step turn
it shares with them), and the code it runs calls ``pause_point()`` between short pieces
of work (the engine's kernels: at each launch). There, while a step holds the turn, the
thread waits off the interpreter until the step lets go.

The platforms' captures are ``unpaused()``: a graph is recorded without a pause.

Guarantees: ``pause_point`` returns at once on a thread outside ``beside``, inside
``unpaused()``, and on its own thread while that thread holds the turn (a step cannot
hold it then); otherwise it
waits while a step holds the turn, and returns when the step lets go (or after the
turn's bound on one wait: ``ostinato.background.STEP_WAIT_S``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Protocol


class StepTurn(Protocol):
    """The lock the steps hold while they launch (``ostinato.background.Turn``)."""

    def wait_while_stepping(self) -> None:
        """Returns once no step on another thread holds the turn (or after a bound)."""


_BESIDE: contextvars.ContextVar[StepTurn | None] = contextvars.ContextVar(
    "ostinato_beside_the_steps", default=None
)


@contextlib.contextmanager
def beside(turn: StepTurn) -> Iterator[None]:
    """Inside, this thread works beside the steps that hold ``turn``: its
    ``pause_point()`` calls wait while one of them does."""
    token = _BESIDE.set(turn)
    try:
        yield
    finally:
        _BESIDE.reset(token)


@contextlib.contextmanager
def unpaused() -> Iterator[None]:
    """Inside, this thread's pause points pass: it records a graph. A pause there would
    hold the capture open while the steps run, and PyTorch's allocator keeps every block
    freed during a capture from being reused until it ends: on an H200 the eager steps
    beside it then allocated afresh and took 13 ms instead of 1."""
    token = _BESIDE.set(None)
    try:
        yield
    finally:
        _BESIDE.reset(token)


def pause_point() -> None:
    """On a thread inside ``beside(turn)``: waits while a step holds ``turn``. Elsewhere
    it returns at once (one context-variable read: the steps' own launches call it too)."""
    turn = _BESIDE.get()
    if turn is not None:
        turn.wait_while_stepping()
