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
the other, whose next wait raises ``UbatchAborted``; ``UbatchThreads.run`` re-raises the first
thread's exception (its traceback attached) in the caller.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ostinato.turns import current_turn, taking_turns


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
    turn = current_turn()
    return turn if isinstance(turn, UbatchTurn) else None


class UbatchThreads:
    """``n`` threads, started once, that run the micro-batches of every step given to
    ``run``. ``prepare`` runs once in each thread when it starts (CUDA state such as the
    device and the BLAS handle), so a step captured in a graph later finds them ready:
    nothing is initialised while the capture runs.

    Guarantees: ``run`` returns the results in micro-batch order or raises the first
    exception of any thread (its traceback attached), with no thread left waiting; the
    threads serve the next ``run`` either way. ``close`` ends them.
    """

    def __init__(self, n: int, ops: StreamOps, prepare: Callable[[], None] | None = None) -> None:
        self.n, self.ops = n, ops
        self._jobs = [threading.Event() for _ in range(n)]
        self._done = threading.Barrier(n + 1)
        self._job: tuple[Callable[[int], Any], Any, Any, _Shared] | None = None
        self._results: list[Any] = [None] * n
        self._errors: list[tuple[int, BaseException]] = []
        self._closed = False
        started = threading.Barrier(n + 1)
        self._threads = [
            threading.Thread(
                target=self._serve,
                args=(i, prepare, started),
                name=f"ostinato-ubatch{i}",
                daemon=True,
            )
            for i in range(n)
        ]
        for t in self._threads:
            t.start()
        try:
            started.wait()
        except threading.BrokenBarrierError:
            pass
        if self._errors:
            self.close()
            raise self._errors[0][1]

    def _serve(
        self, i: int, prepare: Callable[[], None] | None, started: threading.Barrier
    ) -> None:
        try:
            if prepare is not None:
                prepare()
        except BaseException as exc:  # noqa: BLE001  (reported by __init__)
            self._errors.append((i, exc))
            started.abort()
            return
        try:
            started.wait()
        except threading.BrokenBarrierError:
            return  # another thread's prepare failed; __init__ reports it
        while True:
            self._jobs[i].wait()
            self._jobs[i].clear()
            if self._closed:
                return
            assert self._job is not None
            step, compute, comm, shared = self._job
            self._run_one(i, step, compute, comm, shared)
            try:
                self._done.wait()
            except threading.BrokenBarrierError:
                return

    def _run_one(
        self, i: int, step: Callable[[int], Any], compute: Any, comm: Any, shared: _Shared
    ) -> None:
        turn = UbatchTurn(i, shared, self.ops, compute, comm)
        try:
            with taking_turns(turn):
                self.ops.use(compute)
                turn._wait()
                self._results[i] = step(i)
            shared.turns[(i + 1) % self.n].set()  # done: the next one may finish too
        except BaseException as exc:  # noqa: BLE001  (reported to the caller by run)
            self._errors.append((i, exc))
            shared.aborted.set()
            for event in shared.turns:
                event.set()

    def run(
        self,
        step: Callable[[int], Any],
        compute: Any,
        comm: Any,
        start: Callable[[], Any] | None = None,
    ) -> list[Any]:
        """Runs ``step(i)`` for micro-batches ``0..n-1``, taking turns in order
        (micro-batch 0 first); returns their results in order. ``start``, if given, is
        entered around the run (a graph capture, after every thread is ready)."""
        if self._closed:
            raise RuntimeError("UbatchThreads: closed")
        shared = _Shared([threading.Event() for _ in range(self.n)])
        self._job, self._results, self._errors = (step, compute, comm, shared), [None] * self.n, []
        with start() if start is not None else contextlib.nullcontext():
            shared.turns[0].set()
            for job in self._jobs:
                job.set()
            self._done.wait()
        self._job = None
        if self._errors:
            # The cause, not the other thread's reaction to it.
            errors = self._errors
            raise min(errors, key=lambda e: isinstance(e[1], UbatchAborted))[1]
        return list(self._results)

    def close(self) -> None:
        """Ends the threads (they are daemons: a process may also just exit)."""
        self._closed = True
        for job in self._jobs:
            job.set()
        self._done.abort()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=1.0)
