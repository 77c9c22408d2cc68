"""``Peers``: the other ranks of a parallel engine as this rank sees them: the worker
processes it started (when it is rank 0 of a plain Python process), the failure board,
the watchdog over a step's device wait, and what a rank does when a step fails.

Guarantees: a rank whose step failed stops (it is out of step with its peers) and names
the cause: the peer whose failure caused it, or itself, reported on the failure board so
the peers' collectives fail now rather than at their timeout; ``close`` leaves no worker
process behind.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ostinato.distributed.failure import ParallelError, RankFailure, describe
from ostinato.distributed.groups import (
    ParallelConfig,
    ParallelGroups,
    abort_parallel,
    launched_by_torchrun,
    shutdown_parallel,
)
from ostinato.distributed.watchdog import PeerWatchdog
from ostinato.engine.parallel.step_mirror import SchedulerChange
from ostinato.engine.parallel.workers import Command, WorkerPool


class Peers:
    """This rank's view of the others (see the module docstring). ``workers``: the
    processes of ranks 1.. when this process started them (None for one process, and
    under ``torchrun``, where every rank builds its own engine)."""

    def __init__(
        self,
        config: ParallelConfig,
        device: torch.device,
        make_engine: Callable[..., Any],
        engine_args: Any,
    ) -> None:
        self.world_size = config.world_size
        self.device = device
        self.parallel: ParallelGroups | None = None  # once the process group is joined
        self.failure: RankFailure | None = None  # this engine stopped, and why
        self.workers: WorkerPool | None = None
        if config.world_size == 1 or launched_by_torchrun():
            return
        if device.type == "cuda" and torch.cuda.device_count() < config.world_size:
            raise ParallelError(
                f"tensor_parallel_size * data_parallel_size = {config.world_size} ranks, but "
                f"this host has {torch.cuda.device_count()} GPU(s); lower them or use "
                "torchrun across hosts"
            )
        self.workers = WorkerPool(config.world_size, make_engine, engine_args)

    @property
    def launch_env(self) -> dict[str, str] | None:
        """The process group's environment for this rank, when it started the others."""
        return self.workers.driver_env if self.workers else None

    @property
    def health(self) -> Callable[[], RankFailure | None] | None:
        return self.workers.failure if self.workers else None

    def attach(self, parallel: ParallelGroups) -> None:
        """This rank joined the process groups (its failure board is read from now on)."""
        self.parallel = parallel

    def ready(self, timeout_s: float) -> None:
        """This rank's engine is up; with workers, waits until every rank's is."""
        if self.workers is not None:
            self.workers.collect(timeout_s)

    def peer_failure(self) -> RankFailure | None:
        """A failed peer rank, if one is known: a worker of ours that failed or exited,
        a report on the failure board, or (in a worker) rank 0's process gone."""
        if self.workers is not None:
            failure = self.workers.failure()
            if failure is not None:
                return failure
        if self.parallel is not None and self.parallel.failures is not None:
            failure = self.parallel.failures.read()
            if failure is not None:
                return failure
        parent = multiprocessing.parent_process()
        if parent is not None and not parent.is_alive():
            return RankFailure(0, "its process exited")
        return None

    def check_usable(self) -> None:
        """Raises the failure that stopped this engine, if one did."""
        if self.failure is not None:
            rank = self.parallel.rank if self.parallel is not None else 0
            raise self.failure.error(rank)

    def watchdog(self) -> PeerWatchdog | None:
        """A watchdog over the peers for a parallel engine on a GPU, where this thread can
        hang inside a device call behind a dead peer's collective (on the CPU the
        collective itself fails)."""
        parallel = self.parallel
        if parallel is None or parallel.world_size == 1 or self.device.type != "cuda":
            return None
        return PeerWatchdog(self.peer_failure, lambda: abort_parallel(parallel), parallel.rank)

    @contextlib.contextmanager
    def watching(self) -> Iterator[PeerWatchdog | None]:
        """Inside, the watchdog (if any) watches; yields it for its ``check``."""
        watchdog = self.watchdog()
        with watchdog.watching() if watchdog else contextlib.nullcontext():
            yield watchdog

    def stop_after(self, exc: BaseException) -> None:
        """A parallel engine that raised is out of step with its peers: it stops. Raises
        ``ParallelError`` naming the peer when a peer's failure caused ``exc``; otherwise
        this rank is the cause, says so on the failure board, and leaves the group."""
        parallel = self.parallel
        if parallel is None or parallel.world_size == 1:
            return
        rank = parallel.rank
        peer = self.peer_failure()
        if peer is not None and peer.rank != rank:
            self.failure = peer
            if self.device.type == "cuda":
                # This rank's kernels may still wait on the dead peer in a collective;
                # aborting the communicators ends NCCL's, so the process can exit.
                abort_parallel(parallel)
            raise peer.error(rank) from exc
        self.failure = RankFailure(rank, describe(exc))
        if parallel.failures is not None:
            parallel.failures.report(rank, self.failure.cause)
        if self.workers is not None:
            self.workers.close(timeout_s=5.0)
            self.workers = None
        else:
            shutdown_parallel(5.0)

    def served_steps(
        self, steps: Callable[[], Iterator[None]], watchdog: PeerWatchdog | None
    ) -> Iterator[None]:
        """``steps()``, each checked by ``watchdog``; on a parallel engine a failed step
        stops it, and every later session's steps raise that failure."""
        self.check_usable()
        try:
            for _ in steps():
                if watchdog is not None:
                    watchdog.check()  # a step run after an abort computed nothing valid
                yield
        except Exception as exc:
            self.stop_after(exc)
            raise

    def send_changes(self, command: str, changes: list[SchedulerChange]) -> None:
        """Rank 0's scheduler changes (and the command to step) to every worker."""
        if self.workers is not None:  # gone after a failed step
            self.workers.send({r: Command(command, (changes,)) for r in self.workers.conns})

    def generate(
        self,
        checked: Sequence[Any],
        run: Callable[[list[int], Callable[[int, int], None] | None], list[Any]],
        parallel: ParallelGroups,
        on_token: Callable[[int, int], None] | None,
    ) -> list[Any]:
        """Data parallelism from this process: replica ``d`` (ranks ``[d*tp, (d+1)*tp)``)
        takes prompts ``d, d + dp, ...`` of ``checked`` (``(tokens, params)`` pairs); its
        workers run ``generate`` on their share while this rank runs ``run(share,
        on_token)`` on its own. Returns the outputs in prompt order; ``on_token`` sees
        the other replicas' tokens once they are done."""
        assert self.workers is not None
        tp, dp = parallel.tp.size, parallel.dp_size
        shares = [list(range(d, len(checked), dp)) for d in range(dp)]
        args = [([checked[i][0] for i in s], [checked[i][1] for i in s]) for s in shares]
        self.workers.send({r: Command("generate", args[r // tp]) for r in self.workers.conns})
        first = shares[0]
        mine = run(first, None if on_token is None else lambda i, t: on_token(first[i], t))
        try:
            replies = self.workers.collect(parallel.timeout_s)
        except ParallelError as exc:
            self.failure = RankFailure(-1, str(exc))
            raise
        outputs: list[Any] = [None] * len(checked)
        for d, share in enumerate(shares):
            for i, out in zip(share, mine if d == 0 else replies[d * tp], strict=True):
                outputs[i] = out
                for token in out.token_ids if d and on_token is not None else ():
                    on_token(i, token)
        return outputs

    def failed_start(self, exc: BaseException) -> BaseException | None:
        """After this rank's start-up raised ``exc``: stops the workers and returns the
        peer failure that explains it (None when this rank is the cause)."""
        failure = self.peer_failure()
        if self.workers is not None:
            self.workers.close(timeout_s=5.0)
            self.workers = None
        if failure is not None and not isinstance(exc, ParallelError):
            return failure.error(0)
        return None

    def ask_close(self) -> None:
        """Asks every worker to close its engine and exit (``close`` waits for them)."""
        if self.workers is not None:
            self.workers.request_close()

    def close(self, timeout_s: float) -> bool:
        """Leaves the process group (bounded by ``timeout_s``) and stops the workers;
        False if the group did not shut down in time."""
        done = self.world_size == 1 or shutdown_parallel(timeout_s)
        if self.workers is not None:
            self.workers.close(timeout_s)
            self.workers = None
        return done
