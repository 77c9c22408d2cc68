"""Splitting one step's token rows into micro-batches.

A step's rows are its requests' query tokens in order, then padding up to the padded
size. Micro-batch ``i`` takes rows ``[i * padded / n, (i + 1) * padded / n)`` (the split is
at the padded count, so every micro-batch has a static size a graph can hold); a request
whose tokens cross a split point straddles it: its first tokens go to one micro-batch and
the rest to the next (attention stays right: each token attends by its own position, and
the earlier micro-batch writes its K/V first, layer by layer).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class UbatchSlice:
    """Rows ``tokens`` of the step and the requests ``requests`` with rows in them
    (``requests.stop`` may exceed the number of requests when only padding remains)."""

    tokens: slice
    requests: slice

    @property
    def num_tokens(self) -> int:
        """Rows in this micro-batch, padding included."""
        return self.tokens.stop - self.tokens.start


def can_split(num_tokens: int, padded: int, num_ubatches: int = 2) -> bool:
    """Whether a step of ``num_tokens`` real tokens padded to ``padded`` rows splits into
    ``num_ubatches`` equal micro-batches whose last holds a real token (``split_step``'s
    condition)."""
    return padded % num_ubatches == 0 and num_tokens > padded // num_ubatches * (num_ubatches - 1)


def split_step(query_lens: list[int], padded: int, num_ubatches: int = 2) -> list[UbatchSlice]:
    """The ``num_ubatches`` micro-batches of a step whose requests have ``query_lens``
    tokens, padded to ``padded`` rows. Raises ``ValueError`` when ``padded`` is not a
    multiple of ``num_ubatches``, is smaller than the tokens, or a micro-batch would hold
    no real token (nothing to overlap)."""
    total = sum(query_lens)
    if num_ubatches < 2:
        raise ValueError(f"num_ubatches: must be >= 2, got {num_ubatches}")
    if any(q < 1 for q in query_lens):
        raise ValueError(f"query_lens: every request needs >= 1 token, got {query_lens}")
    if padded < total or padded % num_ubatches:
        raise ValueError(
            f"padded: {padded} rows must hold the {total} tokens and divide into "
            f"{num_ubatches} micro-batches"
        )
    size = padded // num_ubatches
    if not can_split(total, padded, num_ubatches):
        raise ValueError(
            f"{total} tokens leave micro-batch {num_ubatches - 1} of {size} rows empty; "
            "run this step without micro-batching"
        )
    ends = list(itertools.accumulate(query_lens))  # row after each request's last token
    slices = []
    for i in range(num_ubatches):
        lo, hi = i * size, (i + 1) * size
        first = bisect.bisect_right(ends, lo)  # first request with a row >= lo
        last = bisect.bisect_left(ends, min(hi, total))  # request holding row hi - 1
        slices.append(UbatchSlice(slice(lo, hi), slice(first, min(last + 1, len(query_lens)))))
    return slices


def local_query_lens(query_lens: list[int], s: UbatchSlice) -> list[int]:
    """Each request's number of rows inside micro-batch ``s`` (a straddling request
    counts only its rows here)."""
    starts = [0, *itertools.accumulate(query_lens)]
    out = []
    for r in range(s.requests.start, s.requests.stop):
        lo, hi = max(starts[r], s.tokens.start), min(starts[r + 1], s.tokens.stop)
        out.append(hi - lo)
    return out
