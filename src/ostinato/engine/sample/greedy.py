"""Greedy token choice over a large vocabulary in a few short kernels.

``logits.argmax(-1)`` reduces each row in one thread block; for one row of a 128k
vocabulary that single block took 27 µs on the H100, 2% of a 1.5 B decode step. Here
each row is cut into chunks reduced in parallel (``max`` over the last dim), then the
best chunk is picked: three tiny kernels instead of one long one, same result.
"""

from __future__ import annotations

import torch

MAX_CHUNKS = 64
MIN_CHUNK = 512  # below this a row is short enough for one block


def chunks_for(vocab: int) -> int:
    """Chunks a row of ``vocab`` logits is cut into: the largest power of two at most
    ``MAX_CHUNKS`` that divides it and leaves chunks of at least ``MIN_CHUNK``."""
    n = 1
    while n * 2 <= MAX_CHUNKS and vocab % (n * 2) == 0 and vocab // (n * 2) >= MIN_CHUNK:
        n *= 2
    return n


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for 2-D ``logits`` (``[rows, vocab]``), the same index
    (the first maximum on ties): each chunk's max reports its first maximum, and the
    best chunk is the first chunk holding the row's maximum."""
    rows, vocab = logits.shape
    n = chunks_for(vocab)
    if n == 1:
        return logits.argmax(dim=-1)
    values, index = logits.reshape(rows, n, vocab // n).max(dim=-1)  # [rows, n] each
    best = values.argmax(dim=-1)  # [rows]
    return best * (vocab // n) + index.gather(1, best[:, None]).squeeze(1)
