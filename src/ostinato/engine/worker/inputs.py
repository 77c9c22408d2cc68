"""The engine's persistent step inputs: device buffers graphs read, and their staging.

Guarantees: every device input of a step lives in a buffer allocated here once, so
captured graphs replay on new data; rows between the real and the padded token count
are padding rows, written the one way ``PADDING`` says, so they attend to nothing and
write their K/V only to the null block, which no request reads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.scheduler import ScheduledBatch, ScheduledRequest
from ostinato.engine.core.transfer import to_device
from ostinato.engine.model.attention import AttentionMetadata
from ostinato.ubatch.slicing import UbatchSlice, local_query_lens


@dataclass(frozen=True)
class Padding:
    """What a padding row holds: token 0, position -1 (attends to nothing, output zero),
    request row 0, and slot 0 (the first slot of the null block, block 0)."""

    token: int = 0
    position: int = -1
    request: int = 0
    slot: int = 0

    def fill(self, ids: Any, positions: Any, requests: Any, slots: Any, rows: slice) -> None:
        """Makes ``rows`` of the four per-row buffers (device tensors or the numpy views of
        their staging) padding rows: the one place padding is written."""
        ids[rows] = self.token
        positions[rows] = self.position
        requests[rows] = self.request
        slots[rows] = self.slot


PADDING = Padding()


@dataclass(frozen=True)
class StepLayout:
    """Where each scheduled request's rows are: ``logit_rows`` (device: the rows whose
    logits the step needs, in request order: each request's last row, preceded by the
    rows of its draft tokens' predecessors when it verifies a draft) and the host lengths
    (``query_lens`` and ``seq_lens``). ``leading``: those rows are ``0 .. k - 1``."""

    logit_rows: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    leading: bool = False

    @property
    def logit_index(self) -> torch.Tensor | slice:
        """``logit_rows`` as an index: a slice where they are the leading rows (a view,
        where a tensor index is a gather kernel and its launch)."""
        return slice(0, self.logit_rows.shape[0]) if self.leading else self.logit_rows


@dataclass(frozen=True)
class PreviousSample:
    """A launched step's sampled tokens, still on the device: request ``id``'s token is
    ``tokens[index[id]]`` (``tokens``: ``[num scheduled requests]``, long)."""

    tokens: torch.Tensor
    index: dict[int, int]


class StepInputs:
    """Input ids, positions, token-to-request map, slot mapping (``[max_num_batched_tokens]``
    each) and block tables (``[max_num_seqs, blocks_per_seq]``), plus pinned staging.
    ``lora_rows``: the model's per-token LoRA slot input (``LoraWeights.row_slots``),
    written with the rest each step (each row its request's slot, -1 for none and for
    padding); None without LoRA."""

    def __init__(
        self, limits: EngineLimits, device: torch.device, lora_rows: torch.Tensor | None = None
    ) -> None:
        self.limits = limits
        self.device = device
        self.lora_rows = lora_rows
        t = limits.max_num_batched_tokens
        self.input_ids = torch.zeros(t, dtype=torch.long, device=device)  # [T]
        self.positions = torch.full((t,), PADDING.position, dtype=torch.long, device=device)
        self.token_req = torch.zeros(t, dtype=torch.int32, device=device)  # [T] -> table row
        self.slot_mapping = torch.zeros(t, dtype=torch.long, device=device)  # [T] flat slot
        self.block_tables = torch.zeros(  # [S, blocks_per_seq]
            (limits.max_num_seqs, limits.blocks_per_seq), dtype=torch.int32, device=device
        )
        # Pinned host staging, two sets used in turn: the host fills one for step N+1 while
        # step N's copies from the other may still be queued (asynchronous scheduling); by
        # then step N-1, the other set's last reader, has been read back. The request rows
        # are staged as int32, the device buffer's type: a copy that converts goes through
        # a device temporary and a second kernel.
        pin = device.type == "cuda"
        rows = 3 if lora_rows is None else 4
        self.stagings = [
            torch.zeros((rows, t), dtype=torch.long, pin_memory=pin)  # ids, pos, slot(, lora)
            for _ in range(2)
        ]
        self.req_stagings = [torch.zeros(t, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.tables_stagings = [
            torch.zeros_like(self.block_tables, device="cpu", pin_memory=pin) for _ in range(2)
        ]
        # Each set's copies as (device buffer, staged row) pairs, views made once.
        device_rows = [self.input_ids, self.positions, self.slot_mapping]
        device_rows += [] if lora_rows is None else [lora_rows]
        self.copies = [
            [*zip(device_rows, st.unbind(0), strict=True), (self.token_req, req)]
            for st, req in zip(self.stagings, self.req_stagings, strict=True)
        ]
        # 0, 1, 2, ...: the logit rows of a step of one row per request, read, never written.
        self.row_numbers = torch.arange(t, device=device)  # [T]
        self.turn = 0
        # numpy views of the same pinned memory: per-step writes without tensor objects.
        self.staging_np = [st.numpy() for st in self.stagings]
        self.req_np = [req.numpy() for req in self.req_stagings]
        self.tables_np = [tb.numpy() for tb in self.tables_stagings]
        # Per set, the block list each staged table row holds and how many of its blocks
        # are written there (``_stage_tables``).
        self.table_lists: list[list[list[int] | None]] = [
            [None] * limits.max_num_seqs for _ in range(2)
        ]
        self.table_lens = [[0] * limits.max_num_seqs for _ in range(2)]
        self.ranges = np.arange(max(t, limits.max_num_seqs * limits.blocks_per_seq))

    @property
    def staging(self) -> torch.Tensor:
        """The staging set ``copy_staged`` copies from now: ``[3, T]`` ids, positions,
        slots (``[4, T]`` with the LoRA slots); the request rows are ``req_stagings``'."""
        return self.stagings[self.turn]

    @property
    def tables_staging(self) -> torch.Tensor:
        """The block-table staging ``copy_staged`` copies from now."""
        return self.tables_stagings[self.turn]

    def metadata(
        self, n: int, query_lens: list[int], seq_lens: list[int], new_keys: int = 0
    ) -> AttentionMetadata:
        """Attention metadata over the first ``n`` rows of the buffers; ``new_keys``: a
        bound on the step's query lengths (``AttentionMetadata``), 0 for none."""
        return self.rows_metadata(slice(0, n), query_lens, seq_lens, new_keys)

    def rows_metadata(
        self,
        rows: slice,
        query_lens: list[int] | None = None,
        seq_lens: list[int] | None = None,
        new_keys: int = 0,
    ) -> AttentionMetadata:
        """Attention metadata of the buffer rows ``rows``: views of the persistent buffers
        (rows find their requests through ``token_req`` in the whole block table), so a
        graph can hold it, whatever rows it covers (a micro-batch of a captured step
        too); the host lengths only for the torch backend."""
        return AttentionMetadata(
            self.positions[rows],
            self.token_req[rows],
            self.slot_mapping[rows],
            self.block_tables,
            query_lens if query_lens is not None else [],
            seq_lens if seq_lens is not None else [],
            new_keys,
        )

    def ubatch_metadata(
        self, s: UbatchSlice, query_lens: list[int], seq_lens: list[int]
    ) -> AttentionMetadata:
        """Attention metadata of micro-batch ``s`` of a step whose requests have
        ``query_lens`` / ``seq_lens``: its rows, its requests' block-table rows (request
        indices made local), and a straddling request's share of its query (its first
        part ends before the request's last token)."""
        rows = s.tokens
        ends = list(itertools.accumulate(query_lens))
        requests = range(s.requests.start, s.requests.stop)
        # A request cut by the end of this micro-batch has seen only its tokens up to it.
        local_s = [seq_lens[r] - max(0, ends[r] - rows.stop) for r in requests]
        return AttentionMetadata(
            self.positions[rows],
            # Padding rows point at request row 0 (they attend to nothing).
            (self.token_req[rows] - s.requests.start).clamp_(min=0),
            self.slot_mapping[rows],
            self.block_tables[s.requests],
            local_query_lens(query_lens, s),
            local_s,
        )

    def write_rows(
        self,
        positions: torch.Tensor,
        token_req: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
    ) -> None:
        """Stages and copies in a hand-made step of one row per request, without a
        scheduler (benchmarks, tests): each row's position, request and KV slot
        (``[rows]``), and the requests' block tables (``[rows, blocks]``). Input ids are
        the caller's to write into ``input_ids``."""
        rows = len(positions)
        staging = self.staging
        staging[1, :rows] = positions
        self.req_stagings[self.turn][:rows] = token_req
        staging[2, :rows] = slots
        if self.lora_rows is not None:
            staging[3, :rows] = -1  # (no adapter)
        self.tables_staging[:rows, : tables.shape[1]] = tables
        self.table_lists[self.turn] = [None] * self.limits.max_num_seqs  # (rows overwritten)
        self.copy_staged(rows, rows)

    def write_padding(self, stop: int, start: int = 0) -> None:
        """Makes rows ``start..stop`` padding rows on the device (a dummy batch for capture:
        the kernels recorded depend only on the shape)."""
        rows = slice(start, stop)
        PADDING.fill(self.input_ids, self.positions, self.token_req, self.slot_mapping, rows)
        if self.lora_rows is not None:
            self.lora_rows[rows] = -1

    def write(
        self, step: ScheduledBatch, padded: int, previous: PreviousSample | None = None
    ) -> StepLayout:
        """Stages ``step``'s rows, pads them to ``padded`` rows, and copies them to the
        device buffers (asynchronously from pinned memory). Decodes whose token is still
        on the device (``from_previous``) take it from ``previous`` by a device gather.

        Host cost: numpy writes into the pinned staging (through views made once), with
        a fixed number of tensor operations per step whatever the batch size.
        """
        self.turn ^= 1
        ids, pos, slots = self.staging_np[self.turn][:3]
        req_of = self.req_np[self.turn]
        bs = self.limits.block_size
        scheduled = step.scheduled
        # Whole-step numpy writes from a few per-request lists (no numpy call per
        # request: at B = 128 a per-request loop of slice writes cost ~0.6 ms).
        lens = [len(s.tokens) for s in scheduled]
        starts = np.array([s.start for s in scheduled], dtype=np.int64)
        counts = np.array(lens, dtype=np.int64)
        n = int(counts.sum())
        one_row_each = n == len(scheduled)  # (decodes): row r is request r's
        if one_row_each:
            firsts = rows = self.ranges[:n]
            pos[:n] = starts
        else:
            firsts = np.cumsum(counts) - counts  # each request's first row
            rows = np.repeat(self.ranges[: len(scheduled)], counts)
            pos[:n] = np.repeat(starts - firsts, counts) + self.ranges[:n]
        rows_from, source = _from_previous(scheduled, firsts.tolist(), previous)
        if len(rows_from) < len(scheduled):  # (else every input is a previous sample)
            ids[:n] = list(itertools.chain.from_iterable(s.tokens for s in scheduled))
        req_of[:n] = rows
        self._stage_tables([s.request.blocks for s in scheduled])
        p = pos[:n]
        slots[:n] = self.tables_np[self.turn][rows, p // bs] * bs + p % bs
        query_lens, seq_lens = lens, (starts + counts).tolist()
        PADDING.fill(ids, pos, req_of, slots, slice(n, padded))
        if self.lora_rows is not None:
            lora = self.staging_np[self.turn][3]
            lora[:n] = np.repeat([s.request.lora_slot for s in scheduled], counts)
            lora[n:padded] = -1
        self.copy_staged(padded, len(step.scheduled))
        if rows_from:
            assert previous is not None
            self.take_previous(previous.tokens, rows_from, source)
        if one_row_each:
            return StepLayout(self.row_numbers[:n], query_lens, seq_lens, leading=True)
        ends = (firsts + counts).tolist()
        last = [
            i
            for s, end in zip(scheduled, ends, strict=True)
            for i in range(end - 1 - len(s.draft), end)
        ]
        if _counts_up(last):  # (a view of ``row_numbers``: no copy)
            return StepLayout(self.row_numbers[: len(last)], query_lens, seq_lens, leading=True)
        return StepLayout(to_device(last, torch.long, self.device), query_lens, seq_lens)

    def _stage_tables(self, blocks: list[list[int]]) -> None:
        """Stages each request's block list (``blocks``, in step order) into its row of
        this turn's block-table staging, writing only what changed since this set last
        held it. Relies on the scheduler's rule for ``Request.blocks``: a list only grows
        while a request holds it (admission, a preemption or a release gives the request
        a new list). Why: rewriting every row took a third of a decode step's staging."""
        tables = self.tables_np[self.turn]
        held, written = self.table_lists[self.turn], self.table_lens[self.turn]
        for r, b in enumerate(blocks):
            k = written[r] if held[r] is b else 0
            if k != len(b):
                tables[r, k : len(b)] = b[k:]
                held[r], written[r] = b, len(b)

    def take_previous(self, tokens: torch.Tensor, rows: list[int], source: list[int]) -> None:
        """``input_ids[rows[i]] = tokens[source[i]]`` on the device. A steady decode (the
        previous step's requests, in its order, first) is one device copy; otherwise two
        index copies to the device and a gather."""
        if _counts_up(rows) and _counts_up(source):
            self.input_ids[: len(rows)].copy_(tokens[: len(rows)])
            return
        at = to_device(source, torch.long, self.device)
        self.input_ids.index_copy_(0, to_device(rows, torch.long, self.device), tokens[at])

    def copy_staged(self, rows: int, num_reqs: int) -> None:
        """Copies the first ``rows`` staged rows and ``num_reqs`` staged block-table rows
        to the device buffers."""
        for buffer, staged in self.copies[self.turn]:
            buffer[:rows].copy_(staged[:rows], non_blocking=True)
        self.block_tables[:num_reqs].copy_(self.tables_staging[:num_reqs], non_blocking=True)


def _counts_up(values: list[int]) -> bool:
    """Whether ``values`` is ``0, 1, ..., len(values) - 1``."""
    return values == list(range(len(values)))


def _from_previous(
    scheduled: list[ScheduledRequest], firsts: list[int], previous: PreviousSample | None
) -> tuple[list[int], list[int]]:
    """The rows (each request's first) whose input token is the previous step's sample,
    and where in ``previous.tokens`` each one is; refuses a request ``previous`` did not
    sample."""
    rows: list[int] = []
    source: list[int] = []
    for s, first in zip(scheduled, firsts, strict=True):
        if s.from_previous:
            if previous is None or s.request.id not in previous.index:
                raise RuntimeError(
                    f"request {s.request.id}: its input token is the previous step's "
                    "sample, but no previous step sampled it"
                )
            rows.append(first)
            source.append(previous.index[s.request.id])
    return rows, source
