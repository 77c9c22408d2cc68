"""Lookahead's two device ops (``engine.spec.lookahead``) as one Triton launch each on CUDA,
instead of about twenty small torch kernels inside every uniform verify step: the same
numbers as the torch reference there (integer arithmetic only)."""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.launch import launch

ROWS = 256  # rows per program of the prepare kernel


class StepRows(Protocol):
    """The persistent step buffers the two kernels read and complete in place."""

    input_ids: torch.Tensor  # [max_tokens]
    positions: torch.Tensor  # [max_tokens], -1 on padding rows
    token_req: torch.Tensor  # [max_tokens], each row's request
    slot_mapping: torch.Tensor  # [max_tokens]
    block_tables: torch.Tensor  # [max_seqs, blocks_per_seq]


@triton.jit
def _prepare_kernel(
    ids_ptr,
    pos_ptr,
    req_ptr,
    slot_ptr,
    tables_ptr,
    stride_table,
    off_ptr,
    carried_ptr,
    stride_carried,
    windows_ptr,
    stride_window,
    n,
    BLOCK_SIZE: tl.constexpr,
    WINDOW: tl.constexpr,
    ROWS: tl.constexpr,
):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pos = tl.load(pos_ptr + i, mask=i < n, other=-1)
    real = (i < n) & (pos >= 0)  # padding rows (position -1) are left as they are
    req = tl.load(req_ptr + i, mask=real, other=0).to(tl.int64)
    off = tl.load(off_ptr + i, mask=real, other=0)
    kept = tl.load(carried_ptr + req, mask=real, other=0)
    after = tl.load(carried_ptr + stride_carried + req, mask=real, other=0)
    moved = pos + kept
    block = tl.load(tables_ptr + req * stride_table + moved // BLOCK_SIZE, mask=real, other=0)
    cut = tl.minimum(tl.maximum(kept + off - 1, 0), WINDOW - 1)
    drafted = tl.load(windows_ptr + req * stride_window + cut, mask=real, other=0)
    tl.store(ids_ptr + i, tl.where(off == 0, after, drafted), mask=real)
    tl.store(pos_ptr + i, moved, mask=real)
    tl.store(slot_ptr + i, block.to(tl.int64) * BLOCK_SIZE + moved % BLOCK_SIZE, mask=real)


@triton.jit
def _accept_kernel(
    ids_ptr,
    pos_ptr,
    req_ptr,
    off_ptr,
    greedy_ptr,
    carried_ptr,
    stride_carried,
    n,
    num_seqs,
    WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
    SEQS: tl.constexpr,
    NONE: tl.constexpr,
):
    # One program: every row and every request, so the barriers order its phases.
    s = tl.arange(0, SEQS)
    tl.store(carried_ptr + s, NONE, mask=s < num_seqs)
    tl.store(carried_ptr + stride_carried + s, -1, mask=s < num_seqs)
    tl.debug_barrier()
    i = tl.arange(0, BLOCK)
    pos = tl.load(pos_ptr + i, mask=i < n, other=-1)
    real = (i < n) & (pos >= 0)
    req = tl.load(req_ptr + i, mask=real, other=0).to(tl.int64)
    off = tl.load(off_ptr + i, mask=real, other=0)
    greedy = tl.load(greedy_ptr + i, mask=real, other=0)
    nxt = i + 1 < n
    pos_next = tl.load(pos_ptr + i + 1, mask=nxt, other=-1)
    off_next = tl.load(off_ptr + i + 1, mask=nxt, other=0)
    ids_next = tl.load(ids_ptr + i + 1, mask=nxt, other=0)
    # Row i confirms row i + 1 when that row continues its request and holds the draft
    # row i's argmax predicts; a request keeps the drafts before its first non-confirm.
    confirms = nxt & (pos_next >= 0) & (off_next == off + 1) & (ids_next == greedy)
    miss = tl.where(confirms, NONE, off)
    tl.atomic_min(carried_ptr + req, miss, mask=real)
    tl.debug_barrier()
    kept = tl.load(carried_ptr + req, mask=real, other=-1, volatile=True)
    tl.store(carried_ptr + stride_carried + req, greedy, mask=real & (off == kept))
    tl.debug_barrier()
    kept_all = tl.load(carried_ptr + s, mask=s < num_seqs, other=0, volatile=True)
    tl.store(carried_ptr + s, tl.minimum(kept_all, WINDOW), mask=s < num_seqs)


def prepare_rows(
    inputs: StepRows,
    n: int,
    offsets: torch.Tensor,
    carried: torch.Tensor,
    windows: torch.Tensor,
    block_size: int,
) -> None:
    """``VerifyLookahead.prepare`` in one launch."""
    launch(
        _prepare_kernel,
        (triton.cdiv(n, ROWS),),
        inputs.input_ids,
        inputs.positions,
        inputs.token_req,
        inputs.slot_mapping,
        inputs.block_tables,
        inputs.block_tables.stride(0),
        offsets,
        carried,
        carried.stride(0),
        windows,
        windows.stride(0),
        n,
        BLOCK_SIZE=block_size,
        WINDOW=windows.shape[1],
        ROWS=ROWS,
    )


def accept_rows(
    inputs: StepRows,
    n: int,
    offsets: torch.Tensor,
    greedy: torch.Tensor,
    carried: torch.Tensor,
    window: int,
    no_miss: int,
) -> None:
    """``VerifyLookahead.accept`` in one launch (one program over all ``n`` rows);
    ``no_miss`` is the caller's sentinel for "every draft confirmed"."""
    seqs = carried.shape[1]
    launch(
        _accept_kernel,
        (1,),
        inputs.input_ids,
        inputs.positions,
        inputs.token_req,
        offsets,
        greedy,
        carried,
        carried.stride(0),
        n,
        seqs,
        WINDOW=window,
        BLOCK=triton.next_power_of_2(max(n, 16)),
        SEQS=triton.next_power_of_2(max(seqs, 16)),
        NONE=no_miss,
        num_warps=8,
    )
