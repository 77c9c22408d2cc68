"""Row argmax of ``[rows, vocab]`` logits in two short launches, graph-safe: torch's
``argmax(dim=-1)`` index (the first maximum on ties, a NaN counting as the maximum).

A row of a large vocabulary reduced by one thread block is a long serial walk (27 µs
for 128k logits on the H100); torch's chunked max, argmax of the chunks, gather and index
arithmetic are five kernels after the LM head. Here the first kernel's programs each
reduce ``CHUNK`` logits of a row to one int64 that orders as (value, then the smaller
index) and store it; the second kernel takes each row's largest and unpacks its index
(and, asked to, counts it in a penalties' table: ``adjust.count_tokens``' count, which
in torch ops is five more kernels, an ``index_add_`` among them, whose first use in a
process held another thread's graph launch 14-21 ms on an H100).
Both write every element they own, so nothing is reset between graph replays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.launch import launch, pdl_arg, pdl_for
from ostinato.engine.kernels.pdl import pdl_enter

CHUNK = 1024  # logits a program reduces: 126 programs for a row of a 128k vocabulary
WARPS = 4
MAX_VOCAB = 1 << 24  # 16384 chunks: the second kernel holds a row's keys in one tile
# A packed key's low half holds index ^ LOW (= LOW - index): of equal values, the
# smaller index orders higher.
LOW = tl.constexpr(0xFFFFFFFF)
EMPTY = tl.constexpr(-(2**63))  # below every packed key


@triton.jit
def packed_max(x, cols, live, vocab):
    """The largest of ``x`` where ``live`` and its first column there, as one int64 that
    orders as (value, then the smaller column), a NaN above every value and the first
    NaN its column (``torch.argmax``'s answer); ``unpacked`` gives the column back."""
    nan = (x != x) & live
    best = tl.max(x, axis=0)
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    hit = tl.where(any_nan, nan, live & (x == best))
    first = tl.min(tl.where(hit, cols, vocab), axis=0)
    key = tl.where(any_nan, 0x7FFFFFFF, ordered_bits(best))
    return (key.to(tl.int64) << 32) + (first.to(tl.int64) ^ LOW)


@triton.jit
def ordered_bits(x):
    """Float32 ``x`` as an int32 that orders as the floats do: a negative float's
    magnitude bits flipped; -0.0 is +0.0 (argmax ties them), a NaN above +inf."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(x == 0.0, 0, key)


@triton.jit
def entry_keys(x, cols):
    """Per entry of float32 ``x``, an int64 that orders as (value, then the smaller
    column): one reduction finds both (``unpacked``, ``key_value`` read them back)."""
    return (ordered_bits(x).to(tl.int64) << 32) + (cols.to(tl.int64) ^ LOW)


@triton.jit
def unpacked(key):
    """The column of a ``packed_max`` or ``entry_keys`` key."""
    return (key & LOW) ^ LOW


@triton.jit
def key_value(key):
    """The float32 value of an ``entry_keys`` key (-0.0 read back as +0.0)."""
    high = (key >> 32).to(tl.int32)
    return tl.where(high >= 0, high, high ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _chunk_best_kernel(
    logits_ptr, keys_ptr, vocab, stride_r, chunks, CHUNK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    live = cols < vocab
    x = tl.load(logits_ptr + row * stride_r + cols, mask=live, other=float("-inf"))
    tl.store(keys_ptr + row * chunks + chunk, packed_max(x.to(tl.float32), cols, live, vocab))


@triton.jit
def _row_best_kernel(
    keys_ptr, out_ptr, chunks, table_ptr, counts_rows_ptr, vocab,
    CHUNKS: tl.constexpr, COUNT: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Each row's token; COUNT: adds one to ``table[counts_rows[row], token]`` (atomic:
    padding rows share the scratch row)."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    keys = tl.load(keys_ptr + row * chunks + c, mask=c < chunks, other=EMPTY)
    token = unpacked(tl.max(keys, axis=0))
    tl.store(out_ptr + row, token)
    if COUNT:
        count_token(table_ptr, counts_rows_ptr, row, token, vocab)


@triton.jit
def count_token(table_ptr, counts_rows_ptr, row, token, vocab):
    """Adds one to ``table[counts_rows[row], token]``, as ``adjust.count_tokens`` does
    (atomic: padding rows share the scratch row; int64 offsets, as ``counts_rows`` may be
    int32)."""
    at = tl.load(counts_rows_ptr + row).to(tl.int64) * vocab + token
    tl.atomic_add(table_ptr + at, 1.0, sem="relaxed")


def argmax_rows(
    logits: torch.Tensor,
    pdl: bool = False,
    out: torch.Tensor | None = None,
    counts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64 ``[rows]``) for a 2-D CUDA tensor of floats with
    at most ``MAX_VOCAB`` columns, written into ``out`` when given (contiguous int64
    ``[rows]``) and returned. ``pdl``: launch with programmatic dependent launch
    (compute capability 9.0+) where ``pdl_for`` allows. ``counts`` (a penalties'
    ``table``, float32 ``[table rows, vocab]``, and ``rows``, int ``[rows]``): each row's
    token is also counted at ``table[rows[i], token]``, as ``adjust.count_tokens``
    counts it."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"argmax_rows: logits must be 2-D floats, got {tuple(logits.shape)} {logits.dtype}"
        )
    rows, vocab = logits.shape
    if not 0 < vocab <= MAX_VOCAB:
        raise ValueError(f"argmax_rows: logits need 1 to {MAX_VOCAB} columns, got {vocab}")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif (
        out.shape != (rows,)
        or out.dtype != torch.int64
        or not out.is_contiguous()
        or out.device != logits.device
    ):
        raise ValueError(
            f"argmax_rows: out must be contiguous int64 [{rows}] on {logits.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    table, counts_rows = _count_operands(counts, out, vocab)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    pdl = pdl_for(pdl, rows)
    chunks = triton.cdiv(vocab, CHUNK)
    keys = torch.empty((rows, chunks), dtype=torch.int64, device=logits.device)  # [rows, chunks]
    launch(
        _chunk_best_kernel, (rows, chunks), logits, keys, vocab, logits.stride(0), chunks,
        CHUNK=CHUNK, USE_PDL=pdl_arg(pdl), num_warps=WARPS, launch_pdl=pdl,
    )  # fmt: skip
    launch(
        _row_best_kernel, (rows,), keys, out, chunks, table, counts_rows, vocab,
        CHUNKS=triton.next_power_of_2(chunks), COUNT=counts is not None,
        USE_PDL=pdl_arg(pdl), num_warps=WARPS, launch_pdl=pdl,
    )  # fmt: skip
    return out


def _count_operands(
    counts: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``counts``' table and rows, checked against ``out`` (the tokens' home: the kernel
    writes through them unchecked); without ``counts``, ``out`` for both, which the kernel
    then never reads (nothing allocated a call)."""
    if counts is None:
        return out, out
    table, counts_rows = counts
    rows, device = out.shape[0], out.device
    if (
        table.dtype != torch.float32
        or table.dim() != 2
        or table.shape[1] != vocab
        or not table.is_contiguous()
        or table.device != device
    ):
        raise ValueError(
            f"argmax_rows: counts' table must be contiguous float32 [n, {vocab}] on {device}, "
            f"got {tuple(table.shape)} {table.dtype} on {table.device}"
        )
    if (
        counts_rows.shape != (rows,)
        or counts_rows.dtype not in (torch.int32, torch.int64)
        or counts_rows.device != device
    ):
        raise ValueError(
            f"argmax_rows: counts' rows must be int32 or int64 [{rows}] on {device}, got "
            f"{tuple(counts_rows.shape)} {counts_rows.dtype} on {counts_rows.device}"
        )
    return table, counts_rows.contiguous()
