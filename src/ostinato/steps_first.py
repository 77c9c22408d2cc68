"""Steps first: a thread working beside the steps stands aside while a step launches.

Python runs one thread at a time. A step's launch lets the interpreter go around each
PyTorch call and takes it back after; while another thread runs Python (a background
capture warming up, recording or timing kernels), each take-back waits for that
thread's next switch (``sys.getswitchinterval()``). On an H200, while the engine
measured its kernel plans beside the steps, 2-13 decode steps a second of the 1.5 B
shape took 2.8-12 ms to launch (benchmarks/RESULTS.md).

So a thread that works beside the steps says so (``beside(turn)``, naming the step turn
it shares with them), and the code it runs calls ``pause_point()`` between short pieces
of work (the engine's kernels: at each launch). There, while a step holds the turn, the
thread waits off the interpreter until the step lets go, unless that step runs eagerly
(``Turn.step_runs_eagerly``: the thread's work is what will speed it up). Measured on an
H200 (the 1.5 B shape, 8 rows, every cache empty, benchmarks/RESULTS.md): while the
plans were measured, the median gap between two tokens was 2.0 ms in two runs against
3.4 ms in a run without the timing graphs' pauses (below); main measured 2.8-3.9 ms in
four runs of other calls. While the graphs were captured it was 2.2-2.7 ms in four runs,
against main's 4.0 in the call of two of them.

A graph of the capture plan is recorded ``unpaused()``: its recording is brief and the
turn is released for it (``Platform.records_apart``), and pausing it was not measured
apart. The timing graphs of a measurement pause (``platform.cuda.captured_calls``): the
measurement is mostly their recordings, and the median gap above fell only with them.

Guarantees: ``pause_point`` returns at once on a thread outside ``beside``, inside
``unpaused()``, and on its own thread while that thread holds the turn (a step cannot
hold it then); otherwise it waits while a step holds the turn, and returns when the
step lets go, when the step says it runs eagerly, or after the turn's bound on one wait
(``ostinato.background.STEP_WAIT_S``).
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
    """Inside, this thread's pause points pass (a platform records a graph of the capture
    plan: module docstring)."""
    token = _BESIDE.set(None)
    try:
        yield
    finally:
        _BESIDE.reset(token)


def pause_point() -> None:
    """On a thread inside ``beside(turn)``: waits while a step holds ``turn`` (unless it
    runs eagerly). Elsewhere it returns at once (one context-variable read: the steps'
    own launches call it too)."""
    turn = _BESIDE.get()
    if turn is not None:
        turn.wait_while_stepping()
