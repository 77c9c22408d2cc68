"""Naming the rank that failed, and never waiting forever on one that did.

A rank that raises writes its rank and cause to the ``FailureBoard`` (a key in the process
group's store) before it leaves; the other ranks, whose collective then fails or whose
device never finishes, read the board and raise ``ParallelError`` naming that rank and its
cause. ``wait_for_device`` replaces a blocking device synchronisation where a peer's death
would otherwise hang the host forever (a collective captured in a CUDA graph is invisible
to NCCL's watchdog): it polls the device and the peers' health, and gives up after a
bounded time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ostinato.errors import OstinatoError

_KEY = "ostinato/failure"


class ParallelError(OstinatoError):
    """A parallel configuration that cannot run, or a rank that failed; names which."""


@dataclass(frozen=True)
class RankFailure:
    """Rank ``rank`` stopped because of ``cause`` (one line: exception type and message)."""

    rank: int
    cause: str

    def error(self, here: int) -> ParallelError:
        """The error rank ``here`` raises because of this failure."""
        return ParallelError(
            f"rank {self.rank} failed: {self.cause}; rank {here} stopped with it "
            "(the engine cannot continue; create a new one)"
        )


HealthCheck = Callable[[], "RankFailure | None"]
"""Returns the failure of a peer rank if one is known, else None. Cheap enough to call
every few milliseconds."""


class FailureBoard:
    """The first failure any rank reported, kept in the store every rank shares."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def report(self, rank: int, cause: str) -> None:
        """Records that ``rank`` failed because of ``cause`` (the first report wins)."""
        try:
            self.store.compare_set(_KEY, "", f"{rank}\n{cause}")
        except Exception:  # noqa: BLE001  (a store already gone cannot carry the report)
            pass

    def read(self) -> RankFailure | None:
        """The first reported failure, or None."""
        try:
            if not self.store.check([_KEY]):
                return None
            rank, cause = self.store.get(_KEY).decode().split("\n", 1)
        except Exception:  # noqa: BLE001  (the store's host died: no report to read)
            return None
        return RankFailure(int(rank), cause)


def describe(exc: BaseException) -> str:
    """One line for ``exc``: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def wait_for_device(
    event: torch.cuda.Event,
    health: HealthCheck,
    here: int,
    timeout_s: float,
    check_every_s: float = 0.05,
) -> None:
    """Returns once ``event`` has completed. Raises ``ParallelError`` naming the rank if
    ``health`` reports a failed peer meanwhile, or naming the wait if ``timeout_s`` passes
    with no failure reported (a peer that hangs without failing)."""
    start = last_check = time.monotonic()
    while not event.query():
        now = time.monotonic()
        if now - last_check >= check_every_s:
            last_check = now
            failure = health()
            if failure is not None:
                raise failure.error(here)
            if now - start > timeout_s:
                raise ParallelError(
                    f"rank {here}: the device did not finish a step in {timeout_s:.0f} s and "
                    "no rank reported a failure; a peer is hung (a collective never matched)"
                )
        time.sleep(20e-6)
