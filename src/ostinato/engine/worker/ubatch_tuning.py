"""Choosing, per captured size, between a plain FULL graph and a micro-batched one, from
replay times measured at start-up.

Splitting a step in two halves its matrices' row count: where the step is bound by
reading the weights (decodes, short prefills) each half reads them again, and the split
can cost more than the communication it hides. Only a measurement says which wins on a
given model, GPU and interconnect.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ostinato.batch import BatchDescriptor
from ostinato.distributed.collectives import largest_over_group


@dataclass(frozen=True)
class UbatchTiming:
    """Replay ms of ``descriptor``'s graph captured plainly and as two micro-batches."""

    descriptor: BatchDescriptor
    plain_ms: float
    ubatched_ms: float

    @property
    def speedup(self) -> float:
        """Plain over micro-batched time: above 1 the split is faster."""
        return self.plain_ms / self.ubatched_ms

    def chosen(self, min_speedup: float) -> bool:
        """Whether the micro-batched graph is kept: at least ``min_speedup`` times faster."""
        return self.speedup >= min_speedup


def measure(
    candidates: Sequence[BatchDescriptor],
    time_ms: Callable[[BatchDescriptor, bool], float],
    group: Any = None,
) -> list[UbatchTiming]:
    """``time_ms(descriptor, ubatched)`` for every candidate both ways, in order (every
    rank of ``group`` must call this with the same candidates: the timed graphs hold
    collectives that pair up across ranks). With a ``group``, each time is the largest
    over its ranks, so every rank gets the same timings and makes the same choice."""
    times = largest_over_group([[time_ms(d, False), time_ms(d, True)] for d in candidates], group)
    return [UbatchTiming(d, p, u) for d, (p, u) in zip(candidates, times, strict=True)]


def chosen(timings: Sequence[UbatchTiming], min_speedup: float) -> frozenset[BatchDescriptor]:
    """The descriptors whose micro-batched graph is kept."""
    return frozenset(t.descriptor for t in timings if t.chosen(min_speedup))
