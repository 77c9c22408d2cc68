"""Two micro-batches, one thread each, taking turns on the host so that one's collective
runs on the communication stream while the other's matrix work runs on the compute stream.

Each thread holds a ``UbatchTurn``. Only the thread whose turn it is issues work; at a
collective it records where its compute stands, moves to the communication stream (which
waits for that point), issues the collective, and passes the turn; when the turn comes
back it makes the compute stream wait for the collective and goes on. On the device the
two streams then overlap one micro-batch's collective with the other's compute, and the
whole dance can be captured in one graph (both streams join the capture through the
events).

Guarantees: no deadlock on error. A thread that raises marks the pair aborted and wakes
the other, whose next wait raises ``UbatchAborted``; ``run_ubatches`` re-raises the first
thread's exception (its traceback attached) in the caller.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

_CURRENT: contextvars.ContextVar[UbatchTurn | None] = contextvars.ContextVar(
    "ostinato_ubatch", default=None
)


class UbatchAborted(RuntimeError):
    """The other micro-batch's thread failed; this one stops too."""


class StreamOps(Protocol):
    """What the hand-off needs of a device's streams (``CudaStreamOps``, or a fake)."""

    def use(self, stream: Any) -> None:
        """Makes ``stream`` this thread's current stream."""

    def record(self, stream: Any) -> Any:
        """An event marking the work issued so far on ``stream``."""

    def wait(self, stream: Any, event: Any) -> None:
        """Makes ``stream`` wait for ``event``."""


class NoStreams:
    """``StreamOps`` for the CPU, where work is synchronous: nothing to order."""

    def use(self, stream: Any) -> None:
        return None

    def record(self, stream: Any) -> None:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        return None


class CudaStreamOps:
    """``StreamOps`` over ``torch.cuda`` streams and events."""

    def use(self, stream: Any) -> None:
        import torch

        torch.cuda.set_stream(stream)

    def record(self, stream: Any) -> Any:
        import torch

        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)


@dataclass
class _Shared:
    ready: threading.Barrier
    turns: list[threading.Event]
    aborted: threading.Event = field(default_factory=threading.Event)


class UbatchTurn:
    """Micro-batch ``index``'s place in the turn-taking (one per thread)."""

    def __init__(
        self, index: int, shared: _Shared, ops: StreamOps, compute: Any, comm: Any
    ) -> None:
        self.index, self.shared, self.ops = index, shared, ops
        self.compute, self.comm = compute, comm
        self.comm_done: Any = None

    def _wait(self) -> None:
        turn = self.shared.turns[self.index]
        turn.wait()
        turn.clear()
        if self.shared.aborted.is_set():
            raise UbatchAborted(f"micro-batch {self.index}: the other micro-batch failed")

    def pass_turn(self) -> None:
        """Lets the next micro-batch issue work until it passes the turn back."""
        n = len(self.shared.turns)
        self.shared.turns[(self.index + 1) % n].set()
        self._wait()

    def begin_collective(self) -> None:
        """Before a collective: the communication stream waits for this micro-batch's
        compute so far and becomes current."""
        self.ops.wait(self.comm, self.ops.record(self.compute))
        self.ops.use(self.comm)

    def end_collective(self) -> None:
        """After issuing a collective: hands the turn over while it runs, then resumes
        compute once the collective is done (the compute stream waits for it)."""
        self.comm_done = self.ops.record(self.comm)
        self.ops.use(self.compute)
        self.pass_turn()
        self.ops.wait(self.compute, self.comm_done)


def current() -> UbatchTurn | None:
    """The micro-batch turn of this thread, if it runs one."""
    return _CURRENT.get()


def run_ubatches(
    step: Callable[[int], Any],
    n: int,
    ops: StreamOps,
    compute: Any,
    comm: Any,
    prepare: Callable[[], None] | None = None,
    start: Callable[[], Any] | None = None,
) -> list[Any]:
    """Runs ``step(i)`` for micro-batches ``0..n-1`` on ``n`` threads taking turns in
    order (micro-batch 0 first); returns their results in order.

    ``prepare`` runs in each thread before the turn-taking starts (CUDA state such as
    the BLAS handle must exist before a graph capture begins). ``start``, if given, is
    entered by the caller after every thread is ready and held while they run (the graph
    capture). Raises the first exception of any thread, with its traceback; no thread is
    left waiting.
    """
    shared = _Shared(threading.Barrier(n + 1), [threading.Event() for _ in range(n)])
    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException]] = []

    def body(i: int) -> None:
        turn = UbatchTurn(i, shared, ops, compute, comm)
        try:
            if prepare is not None:
                prepare()
            shared.ready.wait()
            _CURRENT.set(turn)
            ops.use(compute)
            turn._wait()
            results[i] = step(i)
            shared.turns[(i + 1) % n].set()  # done: the next one may finish too
        except BaseException as exc:  # noqa: BLE001  (reported to the caller below)
            errors.append((i, exc))
            shared.aborted.set()
            shared.ready.abort()  # the caller and the others stop waiting for this thread
            for event in shared.turns:
                event.set()

    threads = [
        threading.Thread(target=body, args=(i,), name=f"ostinato-ubatch{i}", daemon=True)
        for i in range(n)
    ]
    for t in threads:
        t.start()
    try:
        shared.ready.wait()
    except threading.BrokenBarrierError:
        pass  # a thread failed in prepare; its error is reported below
    with start() if start is not None else contextlib.nullcontext():
        shared.turns[0].set()
        for t in threads:
            t.join()
    if errors:
        # The cause, not the other thread's reaction to it.
        reactions = (UbatchAborted, threading.BrokenBarrierError)
        raise min(errors, key=lambda e: isinstance(e[1], reactions))[1]
    return results
