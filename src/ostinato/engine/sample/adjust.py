"""What changes a request's logits before its token is picked: its ``logit_bias`` and its
presence and frequency penalties (``SamplingParams``), on the device.

The penalties read the tokens each request has generated so far (``output_history``):
those the host has recorded, then, under asynchronous scheduling, the one the last step
sampled and the host has not read back yet, taken from the device, so a step never
waits for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ostinato.engine.core.params import SamplingParams
from ostinato.engine.core.scheduler import ScheduledRequest
from ostinato.engine.core.transfer import to_device


def output_history(
    scheduled: Sequence[ScheduledRequest],
    pending: tuple[torch.Tensor, Mapping[int, int]] | None,
    vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """``[rows, longest]`` long on ``device``: row i holds the tokens request i of the
    step has generated so far, padded with ``vocab`` (no token). ``pending``: the last
    step's sampled tokens on the device and the row of each request's there (a
    ``PreviousSample``'s), where a request's is not recorded yet (``num_pending``); it
    comes last. Only rows whose request is penalized are filled: the others are padding."""
    rows: list[list[int]] = []
    where: list[int] = []  # per row: its pending token's index in the last step's, or -1
    for s in scheduled:
        r = s.request
        penalized = r.params.penalized
        rows.append(r.output if penalized else [])
        at = pending[1].get(r.id, -1) if pending is not None and r.num_pending else -1
        where.append(at if penalized else -1)
    width = max(len(row) for row in rows) + 1  # (+1: room for the pending token)
    host = [row + [vocab] * (width - len(row)) for row in rows]
    history = to_device(host, torch.long, device)
    if any(at >= 0 for at in where):
        assert pending is not None  # (the rows found there)
        at = to_device(where, torch.long, device)
        last = pending[0][at.clamp(min=0)]
        # each pending token into its row's first free column
        free = to_device([len(row) for row in rows], torch.long, device)
        column = torch.where(at >= 0, last, torch.full_like(last, vocab))
        history.scatter_(1, free[:, None], column[:, None])
    return history


def adjusted_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], history: torch.Tensor | None
) -> torch.Tensor:
    """``logits`` (``[rows, vocab]``) with each row's bias added and penalties subtracted
    (a float32 copy: the step's logits may be a graph's static output). ``history``:
    ``output_history``'s, needed where a row is penalized."""
    out = logits.float().clone()
    _add_bias(out, params)
    if any(p.penalized for p in params):
        if history is None:
            raise ValueError("adjusted_logits: penalized rows need their output history")
        _penalize(out, params, history)
    return out


def _add_bias(out: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    pairs = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias]
    if not pairs:
        return
    rows, ids, values = zip(*pairs, strict=True)
    device = out.device
    index = (to_device(list(rows), torch.long, device), to_device(list(ids), torch.long, device))
    out.index_put_(index, to_device(list(values), torch.float32, device), accumulate=True)


def _penalize(out: torch.Tensor, params: Sequence[SamplingParams], history: torch.Tensor) -> None:
    rows, vocab = out.shape
    counts = torch.zeros((rows, vocab + 1), dtype=torch.float32, device=out.device)
    counts.scatter_add_(1, history, torch.ones_like(history, dtype=torch.float32))
    counts = counts[:, :vocab]  # (column ``vocab``: the padding)
    presence = to_device([p.presence_penalty for p in params], torch.float32, out.device)
    frequency = to_device([p.frequency_penalty for p in params], torch.float32, out.device)
    out -= presence[:, None] * (counts > 0) + frequency[:, None] * counts
