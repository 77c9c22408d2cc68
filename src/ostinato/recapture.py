"""A FULL graph captured again between steps, and the faster of the two kept: the work of
``GraphManager.recapture`` (its docstring says what is guaranteed). The new graph goes
into the manager's shared pool and onto its static outputs; until the choice is made the
steps replay the old one."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ostinato.batch import BatchDescriptor
from ostinato.graph import GraphEntry, GraphWrapper
from ostinato.guard import capture_phase
from ostinato.platform import Platform, exclusive_device
from ostinato.platform.base import Held

# ``keep_new(old, new, held)``: replays of the old and the new graph, and a hold to take
# around each round of them; whether the new graph stays.
KeepNew = Callable[[Callable[[], None], Callable[[], None], Held], bool]

_NO_TURN = contextlib.nullcontext()


@dataclass(frozen=True)
class Recapture:
    """What capturing a manager's graph again needs of it: its FULL wrapper,
    ``capture_anew(descriptor, turn)`` (a new graph of that descriptor, warm-ups included,
    its entry returned, not installed; holding ``turn`` where given, as the manager's
    ``recapture`` says), ``prepare`` (the dummy inputs' metadata) and the platform."""

    full: GraphWrapper
    capture_anew: Callable[[BatchDescriptor, Held | None], GraphEntry]
    prepare: Callable[[BatchDescriptor], Any] | None
    platform: Platform

    def __call__(self, descriptor: BatchDescriptor, keep_new: KeepNew, turn: Held | None) -> bool:
        """``GraphManager.recapture(descriptor, keep_new, turn)``."""
        entries = self.full.entries
        if descriptor not in entries:
            raise KeyError(f"recapture: no FULL graph was captured for {descriptor}")
        with exclusive_device(), capture_phase(collect=False), torch.inference_mode():
            new = self.capture_anew(descriptor, turn)  # (steps replay the old one meanwhile)
        old = entries[descriptor]
        try:
            kept = self._choose(descriptor, keep_new, old, new, turn)
            with turn() if turn is not None else _NO_TURN, exclusive_device():
                self.platform.synchronize()  # neither graph's replay is still queued
                entries[descriptor] = new if kept else old
                (old if kept else new).graph.reset()
        except BaseException:  # (a failed choice, or a turn refused: a stop)
            if entries.get(descriptor) is not new:  # no step ever replayed it
                with exclusive_device():
                    self.platform.synchronize()  # (the choice's own replays)
                    new.graph.reset()
            raise
        return kept

    def _choose(
        self,
        descriptor: BatchDescriptor,
        keep_new: KeepNew,
        old: GraphEntry,
        new: GraphEntry,
        turn: Held | None,
    ) -> bool:
        """``keep_new``'s choice between ``old`` and ``new``."""
        meta: list[Any] = [None]
        replays = (
            lambda: self.full.replay_entry(old, meta[0]),
            lambda: self.full.replay_entry(new, meta[0]),
        )
        if turn is None:
            meta[0] = self._dummy(descriptor)
            # ``keep_new``'s timer may synchronize the device between its replays (the
            # host-clock one does), which would fail another engine's capture in progress:
            # it waits for that capture, then holds the device through the choice (and its
            # timings do not count the wait).
            with exclusive_device():
                return keep_new(*replays, contextlib.nullcontext)

        @contextlib.contextmanager
        def held() -> Iterator[None]:
            with turn(), exclusive_device():
                # No drain of the steps' queued work, which reads the inputs ``prepare``
                # writes: its writes are device work queued behind it on the steps' stream
                # (and the timed replays' clock starts after it: ``held_replay_us``), so
                # a step waits for the queueing and the device for one replay.
                meta[0] = self._dummy(descriptor)
                yield

        return keep_new(*replays, held)

    def _dummy(self, d: BatchDescriptor) -> Any:
        return self.prepare(d) if self.prepare is not None else None
