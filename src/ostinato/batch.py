"""BatchDescriptor: the key under which one graph is captured and replayed; CaptureItem:
a descriptor with the mode to capture it in."""

from __future__ import annotations

from dataclasses import dataclass

from ostinato.modes import GraphMode


@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """The shape of one (padded) step: the key of a graph.

    Frozen and hashable. ``num_reqs`` is set only for uniform decode batches, where the
    request count is fixed by the token count; mixed batches leave it ``None`` because a
    mixed graph serves any split of its tokens into requests.
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform_decode: bool = False
    has_lora: bool = False


@dataclass(frozen=True)
class CaptureItem:
    """One unit of capture: a descriptor and the runtime mode to capture it in."""

    descriptor: BatchDescriptor
    mode: GraphMode
