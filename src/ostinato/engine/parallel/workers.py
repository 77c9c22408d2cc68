"""Engine worker processes for ``LLM(..., tensor_parallel_size=N)`` started from a plain
Python process (no ``torchrun``): the user's process is rank 0 and drives ranks 1..N-1,
one process per GPU, each running the same engine on its shard.

Every command (``generate``, ``close``) goes to every worker over a pipe before rank 0
runs its own share; the workers answer with their outputs or with the one-line cause of
their failure. A served engine sends each step instead (``step_mirror``), unanswered.
A worker that fails leaves at once (its peers' collectives then fail instead of
waiting), and the driver names it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ostinato.distributed.failure import ParallelError, RankFailure, describe
from ostinato.distributed.groups import local_launch_env
from ostinato.engine.core.heap import call_unpickled
from ostinato.engine.parallel.step_mirror import END, STEP, StepFollower


@dataclass(frozen=True)
class Command:
    """What every worker runs: ``name`` is ``"generate"`` (``args``: its replica's
    prompts and params), ``"close"``, or one of ``step_mirror``'s ``STEP`` / ``END``
    (``args``: rank 0's scheduler changes since the last step)."""

    name: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Reply:
    """A worker's answer: ``value`` on success, else the one-line ``error``."""

    rank: int
    value: Any = None
    error: str | None = None


_EXITED = "its process exited"
# Why a spawned worker most often dies before its engine is up.
_STARTUP_HINT = (
    " while starting (its traceback is printed above; a script that creates the LLM "
    "outside `if __name__ == '__main__':` makes every spawned worker fail this way)"
)


class WorkerPool:
    """Ranks 1..world-1 of a local parallel run, started with ``spawn``.

    Guarantees: ``close`` leaves no worker process behind (it kills those that do not
    exit in time); ``failure`` names a worker that reported an error or exited.
    """

    def __init__(
        self,
        world_size: int,
        engine: Callable[..., Any],
        engine_args: Any,
        stale_s: float = 15.0,
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.driver_env = local_launch_env(0, world_size, port)
        ctx = mp.get_context("spawn")
        self.conns: dict[int, multiprocessing.connection.Connection] = {}
        self.procs: dict[int, mp.process.BaseProcess] = {}
        self.pending: dict[int, Reply] = {}
        # ``failure`` is also called from the engine's watchdog thread: one reader of the
        # pipes at a time.
        self._lock = threading.Lock()
        self.started = False  # every worker has answered once (its engine is up)
        # Each worker stamps its beat every second; a process that dies with kernels in
        # flight can hang in its exit with its pipe still open, and only the silence of
        # its beat shows it is gone.
        self.stale_s = stale_s
        self.beats: dict[int, Any] = {}
        for rank in range(1, world_size):
            ours, theirs = ctx.Pipe()
            self.beats[rank] = beat = ctx.Value("d", 0.0, lock=False)  # 0: not beating yet
            env = local_launch_env(rank, world_size, port)
            # The target as bytes: its unpickling imports torch and the engine's modules,
            # which ``call_unpickled`` runs without collections (``heap.quiet_start``).
            target = pickle.dumps((worker_main, (rank, env, engine, engine_args)))
            proc = ctx.Process(
                target=call_unpickled,
                args=(target, theirs, beat),
                name=f"ostinato-rank{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self.conns[rank], self.procs[rank] = ours, proc

    def send(self, commands: dict[int, Command]) -> None:
        """Sends each worker its command."""
        for rank, command in commands.items():
            try:
                self.conns[rank].send(command)
            except (BrokenPipeError, OSError):
                pass  # the worker is gone; ``failure`` names it

    def failure(self) -> RankFailure | None:
        """A worker that answered with an error, or exited (or closed its pipe, which a
        dying process does before a CUDA context with kernels in flight lets it finish);
        None if all are healthy."""
        with self._lock:
            return self._failure()

    def _failure(self) -> RankFailure | None:
        for rank, conn in self.conns.items():
            if rank not in self.pending and _poll(conn):
                try:
                    self.pending[rank] = conn.recv()
                except (EOFError, OSError):
                    self.pending[rank] = Reply(rank, error=_EXITED)
            reply = self.pending.get(rank)
            code = self.procs[rank].exitcode
            hint = "" if self.started else _STARTUP_HINT
            if reply is not None and reply.error == _EXITED and code is not None:
                return RankFailure(rank, f"{_EXITED} with code {code}{hint}")
            if reply is not None and reply.error is not None:
                return RankFailure(rank, reply.error)
            if code is not None and (reply is None or code != 0):
                return RankFailure(rank, f"{_EXITED} with code {code}{hint}")
            silent = silent_for(self.beats[rank].value, time.monotonic(), self.stale_s)
            if code is None and silent is not None:
                return RankFailure(
                    rank, f"no sign of life for {silent:.0f} s (its process hung or is dying)"
                )
        return None

    def collect(self, timeout_s: float) -> dict[int, Any]:
        """Every worker's answer to the last command; ``ParallelError`` naming the rank
        if one failed or does not answer within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while len(self.pending) < len(self.conns):
            failure = self.failure()
            if failure is not None:
                raise failure.error(0)
            if time.monotonic() > deadline:
                missing = sorted(set(self.conns) - set(self.pending))
                raise ParallelError(f"ranks {missing} did not answer in {timeout_s:.0f} s")
            time.sleep(0.005)
        failure = self.failure()
        if failure is not None:
            raise failure.error(0)
        with self._lock:
            replies, self.pending = self.pending, {}
        self.started = True
        return {rank: reply.value for rank, reply in replies.items()}

    def request_close(self) -> None:
        """Asks every worker to close its engine and exit (``close`` waits for them)."""
        self.send({rank: Command("close") for rank in self.conns})

    def close(self, timeout_s: float = 30.0) -> None:
        """Asks every worker to close its engine and exit; kills those still running
        after ``timeout_s``."""
        self.request_close()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns.values():
            conn.close()


def _poll(conn: multiprocessing.connection.Connection) -> bool:
    try:
        return conn.poll()
    except (EOFError, OSError):
        return True  # closed: ``recv`` says so


def silent_for(last_beat: float, now: float, stale_s: float) -> float | None:
    """Seconds a worker has been silent, when that is more than ``stale_s``; None while it
    beats, and before its first beat: a worker still starting (importing torch can take
    longer than ``stale_s`` on a busy machine) is bounded by the start-up timeout instead,
    and a worker that dies while starting is named by its exit, with the start-up hint."""
    if last_beat <= 0.0:
        return None
    silent = now - last_beat
    return silent if silent > stale_s else None


def worker_main(
    rank: int,
    launch_env: dict[str, str],
    engine: Callable[..., Any],
    engine_args: Any,
    conn: multiprocessing.connection.Connection,
    beat: Any,
) -> None:
    """One worker: builds its engine, ``engine(args=engine_args)`` (which joins the process
    group from ``launch_env``), stamps ``beat`` every second, answers ``Reply(rank, ...)`` to each
    command, and exits after ``close``, after a failure (so its peers' collectives fail
    fast), or when rank 0's pipe closes."""
    os.environ.update(launch_env)  # this process's own environment: it is rank ``rank``

    def stamp() -> None:
        while True:
            beat.value = time.monotonic()
            time.sleep(1.0)

    threading.Thread(target=stamp, daemon=True, name="ostinato-beat").start()
    try:
        llm = engine(args=engine_args)
        conn.send(Reply(rank, "ready"))
        served = contextlib.ExitStack()  # while rank 0 serves: this worker's session
        follower: StepFollower | None = None
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):
                command = Command("close")  # rank 0 is gone
            if command.name == "close":
                served.close()
                llm.close()
                with contextlib.suppress(BrokenPipeError, OSError):  # rank 0 may not wait
                    conn.send(Reply(rank, "closed"))
                sys.stdout.flush()
                os._exit(0)  # the interpreter's teardown could wait on the process group
            if command.name in (STEP, END):  # no reply: rank 0 steps on, the group pairs up
                if follower is None:
                    follower = StepFollower(served.enter_context(llm.serving()).mirror)
                follower.follow(command.name, *command.args)
                if command.name == END:
                    served.close()
                    follower = None
                continue
            conn.send(Reply(rank, llm.generate(*command.args)))
    except BaseException as exc:  # noqa: BLE001  (every failure is reported, then exit)
        try:
            conn.send(Reply(rank, error=describe(exc)))
        except (BrokenPipeError, OSError):
            pass
        traceback.print_exc()
        os._exit(1)  # at once: leaving through teardown could wait on dead peers
