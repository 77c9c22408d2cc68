"""A thread that watches the peers while this rank runs steps, because this rank's own
thread cannot: on a GPU it can be stuck inside a device call (a launch, a copy, an
allocation) waiting on a collective whose peer is dead, and no check of its own runs
until that call returns.

On a failed peer the watchdog aborts this process's communicators, which ends the NCCL
kernels waiting on the dead peer, so the stuck call returns and the engine raises
``ParallelError`` naming the rank (``failure`` is set for it to check after every
step: steps that ran after the abort computed nothing valid). A kernel that no abort
ends (the symmetric-memory all-reduce spins on its peer's signal) leaves the device, and
with it the process, stuck for good: if the engine has not stopped ``grace_s`` after the
abort, the watchdog writes the error to stderr and ends the process with ``EXIT_CODE``.
An exit that names the dead rank is better than a hang that names nothing.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ostinato.distributed.failure import HealthCheck, RankFailure

EXIT_CODE = 70  # EX_SOFTWARE: a peer's failure left this process's device stuck


class PeerWatchdog:
    """Watches ``health`` every ``poll_s`` while inside ``watching()``.

    Guarantees: ``abort`` runs at most once, and only after ``health`` reported a
    failure; ``exit`` runs only if ``watching()`` has still not been left ``grace_s``
    after the abort; after ``watching()`` is left, the thread does nothing more.
    """

    def __init__(
        self,
        health: HealthCheck,
        abort: Callable[[], object],
        here: int,
        poll_s: float = 0.1,
        grace_s: float = 15.0,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.health, self.abort, self.here = health, abort, here
        self.poll_s, self.grace_s, self.exit = poll_s, grace_s, exit
        self.failure: RankFailure | None = None
        self.aborted = False

    def check(self) -> None:
        """Raises the ``ParallelError`` naming the failed peer, if one was seen."""
        if self.failure is not None:
            raise self.failure.error(self.here)

    @contextmanager
    def watching(self) -> Iterator[PeerWatchdog]:
        """Watches the peers until the block is left (however it is left)."""
        left = threading.Event()
        thread = threading.Thread(
            target=self._watch, args=(left,), daemon=True, name="ostinato-watchdog"
        )
        thread.start()
        try:
            yield self
        finally:
            left.set()
            thread.join(timeout=self.poll_s * 10)

    def _watch(self, left: threading.Event) -> None:
        while not left.wait(self.poll_s):
            failure = self.health()
            if failure is None:
                continue
            self.failure = failure
            if not self.aborted:
                self.aborted = True
                self.abort()
            if left.wait(self.grace_s):
                return
            message = (
                f"ostinato: {failure.error(self.here)}; this rank's device is still stuck "
                f"{self.grace_s:.0f} s after its communicators were aborted (a kernel waits "
                f"on rank {failure.rank} for good), so the process exits with code "
                f"{EXIT_CODE}\n"
            )
            sys.stderr.write(message)
            sys.stderr.flush()
            self.exit(EXIT_CODE)
            return
