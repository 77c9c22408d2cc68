"""``RequestBook``: the engine's requests by public id, and the aborts asked for them from
any thread. The thread that steps the engine applies the aborts at its step boundaries;
every other thread only writes to the book, under its lock."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ostinato.engine.core.scheduler import Request


@dataclass
class _Entry:
    owner: Hashable  # what reserved it (``release`` names it)
    request: Request | None = None  # None until the stepping thread queues it
    abort: bool = False

    def live(self) -> bool:
        return self.request is None or not self.request.all_finished


class RequestBook:
    """Guarantees: an id names at most one live request; ``abort`` of a live id (queued or
    running, not finished) is applied exactly once, by the stepping thread, at its next
    boundary; an id that is not live is ignored (``abort`` says so by returning False).
    An interrupt (Ctrl-C) anywhere in ``reserve`` or ``release`` leaves no id reserved
    for good: the ids an owner reserved, however many, go with its ``release``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._asked: list[str] = []  # aborts not yet taken
        self._released: list[Hashable] = []  # owners released, their ids not yet dropped

    def reserve(self, request_ids: Sequence[str], owner: Hashable) -> None:
        """Claims ``request_ids`` for new requests of ``owner`` (distinct from every live
        owner), all or none: ``ValueError`` names an id given twice or still live,
        ``TypeError`` one that is not a string. Call ``release(owner)`` afterwards
        whether or not it raised (it drops only what ``owner`` reserved)."""
        for rid in request_ids:
            if not isinstance(rid, str) or not rid:
                raise TypeError(f"request_id: must be a non-empty string, got {rid!r}")
        if len(set(request_ids)) != len(request_ids):
            twice = next(r for r in request_ids if request_ids.count(r) > 1)
            raise ValueError(f"request_id: {twice!r} is given twice")
        with self._lock:
            self._drop_released()
            live = next((r for r in request_ids if r in self._entries), None)
            if live is not None:
                raise ValueError(f"request_id: {live!r} names a request still running")
            self._entries.update({rid: _Entry(owner) for rid in request_ids})  # (one step)

    def bind(self, request_id: str, request: Request) -> None:
        """Records the request queued under a reserved id."""
        with self._lock:
            self._entries[request_id].request = request

    def release(self, owner: Hashable) -> None:
        """Forgets every id ``owner`` reserved (its requests ended, or reserving failed).
        Marked in one step an interrupt cannot split (a list append), then dropped under
        the lock, now or at the book's next use."""
        self._released.append(owner)
        with self._lock:
            self._drop_released()

    def _drop_released(self) -> None:
        """Drops the ids of released owners (the lock held). Interrupted, it leaves the
        owners marked, and the next call drops them."""
        n = len(self._released)
        if not n:
            return
        owners = set(self._released[:n])
        self._entries = {r: e for r, e in self._entries.items() if e.owner not in owners}
        del self._released[:n]

    def abort(self, request_id: str) -> bool:
        """Asks for ``request_id`` to end at the next step boundary; False if no live
        request has that id (never queued, or already ended)."""
        with self._lock:
            self._drop_released()
            entry = self._entries.get(request_id)
            if entry is None or not entry.live():
                return False
            if not entry.abort:
                entry.abort = True
                self._asked.append(request_id)
            return True

    def aborted(self, request_id: str) -> bool:
        """Whether an abort was asked for ``request_id`` (before it was even queued)."""
        with self._lock:
            entry = self._entries.get(request_id)
            return entry is not None and entry.abort

    def take_aborts(self) -> list[Request]:
        """The queued requests with an abort asked and not yet taken (each once). Costs
        nothing when no abort is pending: it is called at every step boundary."""
        if not self._asked:
            return []
        with self._lock:
            taken, waiting = [], []
            for rid in self._asked:
                entry = self._entries.get(rid)
                if entry is None:
                    continue  # ended meanwhile
                if entry.request is None:
                    waiting.append(rid)  # not queued yet: taken at a later boundary
                else:
                    taken.append(entry.request)
            self._asked = waiting
            return taken
