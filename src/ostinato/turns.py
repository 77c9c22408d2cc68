"""Whose turn it is at a collective: the meeting point of micro-batching (which hands the
turn over) and the collectives (which yield it), so that neither imports the other.

A thread that runs a micro-batch sets its ``CollectiveTurn`` with ``taking_turns``; a
collective asks ``current_turn()`` and, when there is one, brackets its work with
``begin_collective`` / ``end_collective`` on the turn's ``comm`` stream.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Protocol


class CollectiveTurn(Protocol):
    """One thread's share of a micro-batched step, as a collective sees it."""

    compute: Any  # the stream its compute runs on (None on the CPU)
    comm: Any  # the stream its collectives run on (None on the CPU)

    def begin_collective(self) -> None:
        """Moves this thread's work to ``comm`` (after its compute so far) and lets the
        other micro-batch compute meanwhile."""

    def end_collective(self) -> None:
        """Returns to ``compute`` once the collective is done, when the turn comes back."""


_CURRENT: contextvars.ContextVar[CollectiveTurn | None] = contextvars.ContextVar(
    "ostinato_collective_turn", default=None
)


def current_turn() -> CollectiveTurn | None:
    """The turn of this thread, if it runs a micro-batch."""
    return _CURRENT.get()


@contextlib.contextmanager
def taking_turns(turn: CollectiveTurn) -> Iterator[None]:
    """Inside, ``current_turn()`` is ``turn`` in this thread."""
    token = _CURRENT.set(turn)
    try:
        yield
    finally:
        _CURRENT.reset(token)
