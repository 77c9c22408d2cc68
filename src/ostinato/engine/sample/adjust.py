"""What changes a request's logits before its token is picked: its ``logit_bias`` and its
presence and frequency penalties (``SamplingParams``), on the device.

The penalties read how often each request has generated each token (``OutputCounts``):
one row of counts per penalized request in a table made once, so the sampling graphs
read it where it is. Whoever samples a step's token counts it in the table at once, on
the device (``sampler.sample``, given the step's penalties, in a sampling graph or an
eager step alike: on CUDA inside its last kernel, else by ``count_tokens``), so a request
that stays in the batch costs the host nothing; the host adds tokens only to a row made
anew (a request's first penalized step, or its return after a preemption), from those
it has recorded and, under asynchronous scheduling, the one the last step sampled and
the host has not read back yet, taken from the device.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ostinato.engine.core.params import SamplingParams
from ostinato.engine.core.scheduler import ScheduledRequest
from ostinato.engine.core.transfer import to_device, to_device_split

Pending = tuple[torch.Tensor, Mapping[int, int]]
"""The last step's sampled tokens on the device, and each request's row there (a
``PreviousSample``'s ``tokens`` and ``index``)."""


@dataclass
class StepCounts:
    """A step's rows of ``OutputCounts.table``: one per scheduled request, the request's
    own where it is penalized and samples this step, else the scratch row (which nothing
    reads with a penalty)."""

    table: torch.Tensor
    rows: list[int]

    @functools.cached_property
    def device_rows(self) -> torch.Tensor:
        """``rows`` on the table's device (copied once)."""
        return to_device(self.rows, torch.long, self.table.device)


class OutputCounts:
    """Per penalized request, how many times it has generated each token: a row of
    ``table`` (``[capacity + 1, vocab]`` float32 on ``device``, made once at its first
    use; the last row is scratch). ``capacity``: the most requests a step schedules.

    Guarantees: after ``for_step``, each penalized request's row counts every token it
    generated before the step (a pending one included), and once the step's sampler has
    called ``count_tokens`` the token it drew too; a request absent from a step is
    forgotten and counted anew from its recorded output when it comes back (after a
    preemption, or a reset); the table never moves (graphs read it)."""

    def __init__(self, vocab: int, capacity: int, device: torch.device) -> None:
        self.vocab, self.capacity, self.device = vocab, capacity, device
        self._table: torch.Tensor | None = None
        self.rows: dict[int, int] = {}  # request id -> its row
        self.counted: dict[int, int] = {}  # request id -> its tokens counted, or to be
        self.free = list(range(capacity - 1, -1, -1))

    @property
    def table(self) -> torch.Tensor:
        if self._table is None:
            self._table = self.new_table()
        return self._table

    def new_table(self) -> torch.Tensor:
        """A zeroed table of ``table``'s shape, type and device (``table`` is one, made
        at its first use; a compile pass counts into another)."""
        shape = (self.capacity + 1, self.vocab)
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    @property
    def scratch(self) -> int:
        """The row of a request that is not penalized, and of padding rows."""
        return self.capacity

    def for_step(
        self, scheduled: Sequence[ScheduledRequest], pending: Pending | None
    ) -> StepCounts:
        """The step's rows (``StepCounts``), each penalized request's brought up to date
        (``pending``: where a request's last token is still on the device). The step's
        sampler must count the tokens it draws (``count_tokens``)."""
        ids = {s.request.id for s in scheduled if s.request.params.penalized}
        for gone in [r for r in self.rows if r not in ids]:
            self.free.append(self.rows.pop(gone))
            del self.counted[gone]
        host: tuple[list[int], list[int]] = ([], [])  # rows, tokens recorded on the host
        device: tuple[list[int], list[int]] = ([], [])  # rows, indices into pending tokens
        rows = []
        for s in scheduled:
            r = s.request
            if r.id not in ids:
                rows.append(self.scratch)
                continue
            if self.counted.get(r.id) != len(r.output) + r.num_pending:  # (else up to date)
                self._update(r.id, r.output, r.num_pending, pending, host, device)
            self.counted[r.id] += s.samples  # (the token this step draws, counted then)
            rows.append(self.rows[r.id] if s.samples else self.scratch)
        if host[0] or device[0]:
            self._add(host, device, pending)
        return StepCounts(self.table, rows)

    def _add(
        self,
        host: tuple[list[int], list[int]],
        device: tuple[list[int], list[int]],
        pending: Pending | None,
    ) -> None:
        """Counts the queued tokens in their rows (``count_tokens``): those recorded on
        the host, then those still in ``pending`` on the device."""
        rows_t, tokens_t, index_t = to_device_split(
            [host[0] + device[0], host[1], device[1]], torch.long, self.device
        )
        if device[1]:
            assert pending is not None  # (the pending rows come from it)
            tokens_t = torch.cat([tokens_t, pending[0][index_t].long()])
        count_tokens(self.table, rows_t, tokens_t)

    def _update(
        self,
        rid: int,
        output: list[int],
        num_pending: int,
        pending: Pending | None,
        host: tuple[list[int], list[int]],
        device: tuple[list[int], list[int]],
    ) -> None:
        """Queues request ``rid``'s tokens that its row has not counted (its row made,
        zeroed, where it has none): in a request that stays in the batch, none."""
        known = len(output) + num_pending
        if rid in self.rows and self.counted[rid] > known:
            # (a drawn token that never reached the output: counted anew)
            self.free.append(self.rows.pop(rid))
        if rid not in self.rows:
            self.rows[rid] = self._new_row()
            self.counted[rid] = 0
        row, start = self.rows[rid], self.counted[rid]
        for token in output[start:]:
            host[0].append(row)
            host[1].append(token)
        at = pending[1].get(rid) if pending is not None and num_pending else None
        if at is not None and start <= len(output):
            device[0].append(row)
            device[1].append(at)
        self.counted[rid] = known

    def _new_row(self) -> int:
        if not self.free:
            raise RuntimeError(
                f"OutputCounts: more than {self.capacity} penalized requests in one step"
            )
        row = self.free.pop()
        self.table[row].zero_()
        return row


def count_tokens(table: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """Adds one to row ``rows[i]``'s count of ``tokens[i]`` for each i (``[n]`` on the
    table's device), in one ``index_add_`` on the flat table (an accumulating
    ``index_put_`` sorts its indices on CUDA: about 0.4 ms of host time a call, measured
    on an H200): the tokens of a row made anew, and off CUDA a step's draws, in a
    sampling graph and an eager step alike (on CUDA the last sampling or argmax kernel
    counts those)."""
    at = rows * table.shape[1] + tokens.long()
    table.view(-1).index_add_(0, at, torch.ones_like(at, dtype=torch.float32))


def eager_adjusted(
    logits: torch.Tensor, params: Sequence[SamplingParams], counts: StepCounts | None
) -> tuple[torch.Tensor, Penalties | None]:
    """What an eager step hands ``sampler.sample``: ``logits`` (``[rows, vocab]``) with
    each row's bias added where a row has one (a float32 copy: the step's logits may be
    a graph's static output), and the penalties of its rows (None where none is
    penalized), which ``sample`` subtracts with a sampling graph's arithmetic (on CUDA in
    its first kernel) and whose table counts what it draws. ``counts``:
    ``OutputCounts.for_step``'s, needed where a row is penalized."""
    if any(p.logit_bias for p in params):
        logits = logits.to(torch.float32, copy=True)
        add_bias(logits, params)
    if not any(p.penalized for p in params):
        return logits, None
    if counts is None:
        raise ValueError("eager_adjusted: penalized rows need their output counts")
    both = [p.presence_penalty for p in params] + [p.frequency_penalty for p in params]
    presence, frequency = to_device(both, torch.float32, logits.device).view(2, -1)
    return logits, Penalties(None, presence, frequency, counts.table, counts.device_rows)


@dataclass(frozen=True)
class Penalties:
    """``penalized``'s operands besides the logits, held together for a sampler that
    applies them on its way (``sampler.sample``; on CUDA inside its first kernel)."""

    bias: torch.Tensor | None
    presence: torch.Tensor
    frequency: torch.Tensor
    table: torch.Tensor
    rows: torch.Tensor

    def operands(self) -> tuple[torch.Tensor | None, ...]:
        """(bias, presence, frequency, table, rows): ``penalized``'s after the logits."""
        return self.bias, self.presence, self.frequency, self.table, self.rows


def penalized(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """float32 ``logits + bias`` (``bias``: ``[rows, vocab]``, None: none) less each
    row's presence penalty on the tokens it has generated and its frequency penalty
    times their counts (``presence``, ``frequency``: ``[rows]``; the counts:
    ``table[rows]``): one arithmetic for eager steps and the sampling graphs, so both
    pick the same tokens (on CUDA one kernel, ``kernels.penalize``)."""
    if logits.is_cuda:
        from ostinato.engine.kernels.penalize import penalize_rows

        return penalize_rows(logits, bias, presence, frequency, table, rows)
    out = logits.float() if bias is None else logits.float() + bias
    counts = table[rows]
    return out - (presence[:, None] * (counts > 0) + frequency[:, None] * counts)


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
