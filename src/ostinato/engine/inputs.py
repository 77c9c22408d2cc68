"""The engine's persistent step inputs: device buffers graphs read, and their staging.

Guarantees: every device input of a step lives in a buffer allocated here once, so
captured graphs replay on new data; rows between the real and the padded token count
are padding rows, written the one way ``PADDING`` says, so they attend to nothing and
write their K/V only to the null block, which no request reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.engine.attention import AttentionMetadata
from ostinato.engine.limits import EngineLimits
from ostinato.engine.scheduler import ScheduledBatch


@dataclass(frozen=True)
class Padding:
    """What a padding row holds: token 0, position -1 (attends to nothing, output zero),
    request row 0, and slot 0 (the first slot of the null block, block 0)."""

    token: int = 0
    position: int = -1
    request: int = 0
    slot: int = 0


PADDING = Padding()


@dataclass(frozen=True)
class StepLayout:
    """Where each scheduled request's rows are: ``last_rows`` (device, one per request:
    the row of its last token) and the host lengths the torch attention backend reads."""

    last_rows: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]


class StepInputs:
    """Input ids, positions, token-to-request map, slot mapping (``[max_num_batched_tokens]``
    each) and block tables (``[max_num_seqs, blocks_per_seq]``), plus pinned staging."""

    def __init__(self, limits: EngineLimits, device: torch.device) -> None:
        self.limits = limits
        self.device = device
        t = limits.max_num_batched_tokens
        self.input_ids = torch.zeros(t, dtype=torch.long, device=device)  # [T]
        self.positions = torch.full((t,), PADDING.position, dtype=torch.long, device=device)
        self.token_req = torch.zeros(t, dtype=torch.int32, device=device)  # [T] -> table row
        self.slot_mapping = torch.zeros(t, dtype=torch.long, device=device)  # [T] flat slot
        self.block_tables = torch.zeros(  # [S, blocks_per_seq]
            (limits.max_num_seqs, limits.blocks_per_seq), dtype=torch.int32, device=device
        )
        # Pinned host staging, reused each step: safe because every step ends by reading the
        # sampled tokens back, which waits for these copies.
        pin = device.type == "cuda"
        self.staging = torch.zeros((4, t), dtype=torch.long, pin_memory=pin)  # ids,pos,req,slot
        self.tables_staging = torch.zeros_like(self.block_tables, device="cpu", pin_memory=pin)

    def metadata(self, n: int, query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        """Attention metadata over the first ``n`` rows of the buffers."""
        return AttentionMetadata(
            self.positions[:n],
            self.token_req[:n],
            self.slot_mapping[:n],
            self.block_tables,
            query_lens,
            seq_lens,
        )

    def write_padding(self, n: int) -> None:
        """Makes the first ``n`` rows padding rows (a dummy batch for capture: the kernels
        recorded depend only on the shape)."""
        self.input_ids[:n].fill_(PADDING.token)
        self.positions[:n].fill_(PADDING.position)
        self.token_req[:n].fill_(PADDING.request)
        self.slot_mapping[:n].fill_(PADDING.slot)

    def write(self, step: ScheduledBatch, padded: int) -> StepLayout:
        """Stages ``step``'s rows, pads them to ``padded`` rows, and copies them to the
        device buffers (asynchronously from pinned memory)."""
        bs = self.limits.block_size
        ids: list[int] = []
        pos: list[int] = []
        req_of: list[int] = []
        slots: list[int] = []
        last, query_lens, seq_lens = [], [], []
        for r, s in enumerate(step.scheduled):
            k = len(s.tokens)
            blocks = s.request.blocks
            ids += s.tokens
            pos += range(s.start, s.start + k)
            req_of += [r] * k
            slots += [blocks[p // bs] * bs + p % bs for p in range(s.start, s.start + k)]
            last.append(len(ids) - 1)
            query_lens.append(k)
            seq_lens.append(s.start + k)
            self.tables_staging[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        n = len(ids)
        staging = self.staging
        for row, values, pad in (
            (0, ids, PADDING.token),
            (1, pos, PADDING.position),
            (2, req_of, PADDING.request),
            (3, slots, PADDING.slot),
        ):
            staging[row, :n] = torch.tensor(values)
            staging[row, n:padded] = pad
        self.copy_staged(padded, len(step.scheduled))
        return StepLayout(to_device(last, torch.long, self.device), query_lens, seq_lens)

    def copy_staged(self, rows: int, num_reqs: int) -> None:
        """Copies the first ``rows`` staged rows and ``num_reqs`` staged block-table rows
        to the device buffers."""
        staging = self.staging
        self.input_ids[:rows].copy_(staging[0, :rows], non_blocking=True)
        self.positions[:rows].copy_(staging[1, :rows], non_blocking=True)
        self.token_req[:rows].copy_(staging[2, :rows], non_blocking=True)
        self.slot_mapping[:rows].copy_(staging[3, :rows], non_blocking=True)
        self.block_tables[:num_reqs].copy_(self.tables_staging[:num_reqs], non_blocking=True)


def to_device(
    values: list[int] | list[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a tensor on ``device``. On CUDA the copy is asynchronous (through
    pinned memory), so the host never waits here for the device's queued work: a step's
    only wait is reading back its tokens, which is where a dead peer is noticed."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
