"""Verify steps scheduled ahead: the device-side half of speculative lookahead.

While greedy verify step N runs, the host schedules step N+1 for the same requests
without knowing how many drafts N keeps (``Scheduler.schedule_ahead``). This module holds
what crosses from N to N+1 on the device, and the ops that use it, run inside the
uniform decode step (so inside its FULL graph, replayed with one call):

- ``prepare`` (before the forward pass): each request's accepted count ``a`` moves its
  staged positions on, its slots are recomputed from the block table, and its input ids
  become the token after the kept drafts followed by ``window[a .. a + len - 2]``;
- ``accept`` (after the argmax): each request's accepted count and that token, kept in
  ``carried`` for the next step.

A step not scheduled ahead stages ``a = 0``, its last token as that token and its draft
as the window, so ``prepare`` reproduces its staged rows exactly; the host then verifies
every step the same way from the argmax it reads back (``speculative.accept_greedy``),
which the rule here equals.
"""

from __future__ import annotations

import torch

from ostinato.engine.core.scheduler import ScheduledBatch
from ostinato.engine.kernels.options import triton_runs_on
from ostinato.engine.worker.inputs import StepInputs

NO_MISS = 1 << 30
"""Above any row offset: "no mismatch in this request's rows" before the minimum."""


class VerifyLookahead:
    """Buffers and ops of lookahead for drafts of up to ``k`` tokens.

    Per request row (``[max_num_seqs]``): ``carried[0]`` the drafts the last verify step
    kept, ``carried[1]`` the token after them (written by ``accept``, or staged);
    ``windows`` (``[max_num_seqs, 2k]``) the tokens the next draft is cut from. Per token
    row (``[max_num_batched_tokens]``): ``offsets``, the row's index within its request.
    Staging is pinned and double-buffered like ``StepInputs``'s.
    """

    def __init__(self, inputs: StepInputs, k: int) -> None:
        self.inputs, self.k = inputs, k
        limits, device = inputs.limits, inputs.device
        s, t = limits.max_num_seqs, limits.max_num_batched_tokens
        self.carried = torch.zeros((2, s), dtype=torch.long, device=device)  # [2, S]
        self.windows = torch.zeros((s, 2 * k), dtype=torch.long, device=device)  # [S, 2k]
        self.offsets = torch.zeros(t, dtype=torch.long, device=device)  # [T]
        pin = device.type == "cuda"
        self.stagings = [
            (
                torch.zeros((2, s), dtype=torch.long, pin_memory=pin),
                torch.zeros((s, 2 * k), dtype=torch.long, pin_memory=pin),
                torch.zeros(t, dtype=torch.long, pin_memory=pin),
            )
            for _ in range(2)
        ]
        self.staging_np = [tuple(x.numpy() for x in st) for st in self.stagings]
        self.turn = 0
        # One Triton launch per op on CUDA (engine.triton_lookahead); torch ops elsewhere.
        self.fused = triton_runs_on(device)

    def stage(self, step: ScheduledBatch, rows: int) -> None:
        """Stages ``step`` (a uniform decode step; all of it scheduled ahead or none of
        it) and copies it to the device buffers, ``rows`` rows padded."""
        self.turn ^= 1
        carried, windows, offsets = self.staging_np[self.turn]
        scheduled = step.scheduled
        ahead = scheduled[0].ahead if scheduled else False
        if any(s.ahead is not ahead for s in scheduled):
            raise RuntimeError("a step is scheduled ahead as a whole or not at all")
        # Whole-step numpy writes, as in StepInputs.write: every request has the same
        # number of rows in a uniform decode step.
        length = len(scheduled[0].tokens) if scheduled else 0
        if any(len(s.tokens) != length for s in scheduled):
            raise RuntimeError(
                "lookahead stages uniform decode steps only (every request the same number "
                "of tokens)"
            )
        n = length * len(scheduled)
        offsets[:n] = self.inputs.ranges[:n] % max(length, 1)
        offsets[n:rows] = 0
        if ahead:
            windows[: len(scheduled)] = [s.window for s in scheduled]
        elif scheduled:
            carried[0, : len(scheduled)] = 0
            carried[1, : len(scheduled)] = [s.tokens[0] for s in scheduled]
            windows[: len(scheduled), : length - 1] = [s.tokens[1:] for s in scheduled]
        host_carried, host_windows, host_offsets = self.stagings[self.turn]
        reqs = len(step.scheduled)
        self.offsets[:rows].copy_(host_offsets[:rows], non_blocking=True)
        self.windows[:reqs].copy_(host_windows[:reqs], non_blocking=True)
        if not ahead:
            self.carried[:, :reqs].copy_(host_carried[:, :reqs], non_blocking=True)

    def prepare(self, n: int) -> None:
        """Completes the first ``n`` rows from ``carried`` (device ops; padding rows,
        position -1, are left as they are)."""
        if self.fused:
            from ostinato.engine.kernels.lookahead import prepare_rows

            prepare_rows(
                self.inputs,
                n,
                self.offsets,
                self.carried,
                self.windows,
                self.inputs.limits.block_size,
            )
            return
        inp = self.inputs
        pos, req = inp.positions[:n], inp.token_req[:n].long()
        offsets = self.offsets[:n]
        real = pos >= 0
        kept = self.carried[0].index_select(0, req)  # [n]
        moved = torch.where(real, pos + kept, pos)
        bs = inp.limits.block_size
        block = inp.block_tables[req, moved.clamp(min=0) // bs].long()
        slots = torch.where(real, block * bs + moved % bs, inp.slot_mapping[:n])
        cut = (kept + offsets - 1).clamp(0, 2 * self.k - 1)
        drafted = self.windows[req, cut]
        ids = torch.where(offsets == 0, self.carried[1].index_select(0, req), drafted)
        inp.input_ids[:n].copy_(torch.where(real, ids, inp.input_ids[:n]))
        pos.copy_(moved)
        inp.slot_mapping[:n].copy_(slots)

    def accept(self, n: int, greedy: torch.Tensor) -> None:
        """From the first ``n`` rows' argmax ``greedy``: per request, the drafts kept
        (those its previous rows' argmax confirm, in order) and the token after them,
        into ``carried`` (device ops; requests without rows get garbage, never read)."""
        if self.fused:
            from ostinato.engine.kernels.lookahead import accept_rows

            accept_rows(self.inputs, n, self.offsets, greedy, self.carried, 2 * self.k, NO_MISS)
            return
        inp = self.inputs
        ids, req = inp.input_ids[:n], inp.token_req[:n].long()
        offsets, real = self.offsets[:n], inp.positions[:n] >= 0
        # Row i confirms row i + 1 when that row continues its request and holds the
        # draft row i's argmax predicts.
        confirms = torch.zeros_like(real)
        confirms[:-1] = (offsets[1:] == offsets[:-1] + 1) & real[1:] & (ids[1:] == greedy[:-1])
        first_miss = torch.where(confirms | ~real, NO_MISS, offsets)
        kept = torch.full_like(self.carried[0], NO_MISS).scatter_reduce_(0, req, first_miss, "amin")
        at_kept = real & (offsets == kept.index_select(0, req))
        after = torch.full_like(self.carried[1], -1).scatter_reduce_(
            0, req, torch.where(at_kept, greedy, -1), "amax"
        )
        self.carried[0].copy_(kept.clamp(max=2 * self.k))
        self.carried[1].copy_(after)
