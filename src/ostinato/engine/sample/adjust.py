"""What changes a request's logits before its token is picked: its ``logit_bias`` and its
presence and frequency penalties (``SamplingParams``), on the device.

The penalties read how often each request has generated each token (``OutputCounts``):
one row of counts per penalized request on the device, brought up to date each step with
the tokens it generated since the last, those the host has recorded and, under
asynchronous scheduling, the one the last step sampled and the host has not read back
yet, taken from the device, so a step never waits for it and costs what its rows do,
not what they have generated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ostinato.engine.core.params import SamplingParams
from ostinato.engine.core.scheduler import ScheduledRequest
from ostinato.engine.core.transfer import to_device, to_device_split

Pending = tuple[torch.Tensor, Mapping[int, int]]
"""The last step's sampled tokens on the device, and each request's row there (a
``PreviousSample``'s ``tokens`` and ``index``)."""


class OutputCounts:
    """Per penalized request, how many times it has generated each token, ``[vocab]``
    float32 on ``device``. Guarantees: ``for_step`` returns, for each request of a step,
    the counts of every token it has generated so far (a pending one included); a
    request absent from a step is forgotten and counted anew from its recorded output
    when it comes back (after a preemption, or a reset)."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.table = torch.zeros((1, vocab), dtype=torch.float32, device=device)  # row 0: zeros
        self.rows: dict[int, int] = {}  # request id -> its row
        self.counted: dict[int, int] = {}  # request id -> tokens counted in its row
        self.free: list[int] = []

    def for_step(
        self, scheduled: Sequence[ScheduledRequest], pending: Pending | None
    ) -> torch.Tensor:
        """``[len(scheduled), vocab]``: each penalized request's counts, zeros for the
        others (``pending``: where a request's last token is still on the device)."""
        ids = {s.request.id for s in scheduled if s.request.params.penalized}
        for gone in [r for r in self.rows if r not in ids]:
            self.free.append(self.rows.pop(gone))
            del self.counted[gone]
        host: tuple[list[int], list[int]] = ([], [])  # rows, tokens recorded on the host
        device: tuple[list[int], list[int]] = ([], [])  # rows, indices into pending tokens
        for s in scheduled:
            r = s.request
            if r.id in ids:
                self._update(r.id, r.output, r.num_pending, pending, host, device)
        rows = [self.rows.get(s.request.id, 0) for s in scheduled]
        # Every index this step needs, in one copy: the flat table indices of the
        # tokens the host has recorded, the pending tokens' places and their rows'
        # starts, and the step's rows.
        host_at = [r * self.vocab + t for r, t in zip(*host, strict=True)]
        starts = [r * self.vocab for r in device[0]]
        host_at_t, at, starts_t, rows_t = to_device_split(
            [host_at, device[1], starts, rows], torch.long, self.device
        )
        if device[1]:
            assert pending is not None  # (the pending rows come from it)
            host_at_t = torch.cat([host_at_t, starts_t + pending[0][at].long()])
        if len(host_at_t):
            # One index_add_ on the flat table: an accumulating index_put_ sorts its
            # indices on CUDA (about 0.4 ms of host time a call, measured on an H200).
            ones = torch.ones_like(host_at_t, dtype=torch.float32)
            self.table.view(-1).index_add_(0, host_at_t, ones)
        return self.table[rows_t]

    def _update(
        self,
        rid: int,
        output: list[int],
        num_pending: int,
        pending: Pending | None,
        host: tuple[list[int], list[int]],
        device: tuple[list[int], list[int]],
    ) -> None:
        """Queues request ``rid``'s tokens generated since its row was last brought up to
        date (its row made, zeroed, where it has none)."""
        if rid not in self.rows:
            self.rows[rid] = self._new_row()
            self.counted[rid] = 0
        row, start = self.rows[rid], self.counted[rid]
        for token in output[start:]:
            host[0].append(row)
            host[1].append(token)
        counted = len(output)
        at = pending[1].get(rid) if pending is not None and num_pending else None
        if at is not None:
            device[0].append(row)
            device[1].append(at)
            counted += 1
        self.counted[rid] = counted

    def _new_row(self) -> int:
        if not self.free:
            grown = torch.zeros_like(self.table).repeat(2, 1)  # (doubled: rows made rarely)
            grown[: len(self.table)] = self.table
            self.free = list(range(len(self.table), len(grown)))
            self.table = grown
        row = self.free.pop()
        self.table[row].zero_()
        return row


def adjusted_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], counts: torch.Tensor | None
) -> torch.Tensor:
    """``logits`` (``[rows, vocab]``) with each row's bias added and penalties subtracted
    (a float32 copy: the step's logits may be a graph's static output). ``counts``:
    ``OutputCounts.for_step``'s, needed where a row is penalized."""
    out = logits.to(torch.float32, copy=True)
    add_bias(out, params)
    if any(p.penalized for p in params):
        if counts is None:
            raise ValueError("adjusted_logits: penalized rows need their output counts")
        both = [p.presence_penalty for p in params] + [p.frequency_penalty for p in params]
        presence, frequency = to_device(both, torch.float32, out.device).view(2, -1)
        penalize(out, presence, frequency, counts)
    return out


def penalize(
    out: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor, counts: torch.Tensor
) -> None:
    """Subtracts each row's presence penalty from the logits of the tokens it has
    generated and its frequency penalty times their counts (``out``: float32 logits, in
    place; ``presence``, ``frequency``: ``[rows]``): one arithmetic for eager steps and
    the sampling graphs, so both pick the same tokens."""
    out -= presence[:, None] * (counts > 0) + frequency[:, None] * counts


def add_bias(out: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Adds each row's ``logit_bias`` to ``out`` (``[rows, vocab]`` float32, in place)."""
    vocab = out.shape[-1]
    pairs = [(r * vocab + t, v) for r, p in enumerate(params) for t, v in p.logit_bias]
    if not pairs:
        return
    flat, values = zip(*pairs, strict=True)
    device = out.device
    # (a token appears once in a request's bias, so the sum has one term per element)
    out.view(-1).index_add_(
        0, to_device(list(flat), torch.long, device), to_device(list(values), torch.float32, device)
    )
