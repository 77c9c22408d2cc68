"""Greedy token choice: each row's argmax, the first maximum on ties.

On CUDA it is two short Triton kernels (``kernels.argmax``) instead of the reduction
torch runs in one thread block per row (27 µs for a 128k vocabulary on the H100) or
the five kernels of a chunked torch version; elsewhere it is ``torch.argmax``.
"""

from __future__ import annotations

import torch

from ostinato.engine.sample.adjust import count_tokens


def greedy_tokens(
    logits: torch.Tensor,
    pdl: bool = False,
    out: torch.Tensor | None = None,
    counts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64 ``[rows]``) for 2-D float ``logits``
    (``[rows, vocab]``), the same index, written into ``out`` when given and returned.
    ``pdl``: on CUDA, launch the kernels with programmatic dependent launch (compute
    capability 9.0+). ``counts`` (a penalties' table and each row's row in it): each
    token counted there too (``adjust.count_tokens``; on CUDA in the second kernel)."""
    if logits.is_cuda:
        from ostinato.engine.kernels.argmax import argmax_rows

        return argmax_rows(logits, pdl, out, counts)
    tokens = torch.argmax(logits, dim=-1, out=out)
    if counts is not None:
        count_tokens(*counts, tokens)
    return tokens
