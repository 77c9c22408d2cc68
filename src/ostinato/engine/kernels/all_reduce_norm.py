"""The tensor-parallel all-reduce, the residual add and the RMSNorm after it, in one
kernel (behind ``ostinato::tp_all_reduce_add_rms_norm``): each rank writes its partial
rows straight into every peer's symmetric-memory buffer (NVLink peer-to-peer stores,
never multicast), waits in its own buffer until every peer's rows have arrived, sums
them in rank order, adds the residual and normalises.

Why one kernel: under tensor parallelism each block ends in an all-reduce whose output
only feeds the next add-and-norm; as two kernels they cost two launches and a round trip
of the sum through memory, 65 times a step on an 8 B model.

Protocol (the data is its own flag). Every element of a buffer not in flight holds the
sentinel -0.0, which no rank sends: a rank sends +0.0 for each -0.0 it holds (the sum
and every rounding after it are unchanged; only a zero's sign can differ from NCCL's).
A reader polls its copy of a peer's row until no element is the sentinel (each element
is stored whole, so an element that is not the sentinel is the peer's), sums, then
writes the sentinel back. No flag, no fence and no read across NVLink: one one-way
write per peer. The buffer has ``SLOTS`` slots, a call using the one its program's
count names (each program counts its calls in ``slots``, modulo ``SLOTS``): a peer
writes a slot again only ``SLOTS`` calls later, after it has read this rank's rows of
the calls between, which this rank sent after it had emptied the slot. Every rank sums
the rows in the same order, so every rank holds the same bits; with two ranks the sum
is the one rounding NCCL makes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.launch import launch, pdl_arg, pdl_for
from ostinato.engine.kernels.pdl import pdl_enter

PROGRAMS = 16
"""Programs per call, whatever the row count (every program of every call waits for its
peers' rows, so the slot counts of all programs stay equal)."""

SLOTS = 3
"""Slots of the buffer, used in turn (see the module docstring)."""

SENTINEL = -0.0
"""What every element of a buffer not in flight holds (its bits: the sign bit alone)."""


@triton.jit
def _sentinels(part, BITS: tl.constexpr):
    # Which elements of ``part`` are -0.0, by their bits (a comparison of values would
    # take +0.0 for it too).
    if BITS == 16:
        return part.to(tl.int16, bitcast=True) == -32768
    else:
        return part.to(tl.int32, bitcast=True) == -2147483648


@triton.jit
def _sentinel_like(part, BITS: tl.constexpr):
    # -0.0 in ``part``'s shape and dtype, made from its bits (a constant -0.0 could fold
    # to +0.0).
    if BITS == 16:
        return tl.full(part.shape, -32768, tl.int16).to(part.dtype, bitcast=True)
    else:
        return tl.full(part.shape, -2147483648, tl.int32).to(part.dtype, bitcast=True)


@triton.jit
def _sent(x_ptr, row, dim, cols, here):
    # This rank's row as every rank sums it: +0.0 for -0.0 (the sentinel).
    x = tl.load(x_ptr + row * dim + cols, mask=here, other=0.0)
    return tl.where(x == 0.0, tl.zeros_like(x), x)


@triton.jit
def _arrived(ptr, here, BITS: tl.constexpr):
    # A peer's row once every element of it has come, then the sentinel written back.
    part = tl.load(ptr, mask=here, other=1.0, volatile=True)
    while tl.sum((_sentinels(part, BITS) & here).to(tl.int32), axis=0) > 0:
        part = tl.load(ptr, mask=here, other=1.0, volatile=True)
    tl.store(ptr, _sentinel_like(part, BITS), mask=here)
    return part


@triton.jit
def _all_reduce_add_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    total_ptr,
    buffers_ptr,
    slots_ptr,
    rows,
    dim,
    segment,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    STEP: tl.constexpr,
    ITERS: tl.constexpr,
    NSLOTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # With PDL the next kernel may launch at once: it can pull its weights while this
    # one waits for the peers' rows (its wait for this kernel's end is its own).
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    slot = tl.load(slots_ptr + pid)
    # Slot ``slot``, then this rank's segment of it in each peer's buffer.
    base = slot.to(tl.int64) * WORLD * segment
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = x_ptr.dtype.element_ty
    mine = tl.load(buffers_ptr + RANK).to(tl.pointer_type(dtype))
    # Program p takes rows p, p + STEP, ... (STEP: the grid; ITERS: rows / STEP rounded
    # up); a masked row past the end does nothing.
    for i in tl.static_range(ITERS):
        row = i * STEP + pid
        here = mask & (row < rows)
        x = _sent(x_ptr, row, dim, cols, here)
        for q in tl.static_range(WORLD):
            if q != RANK:
                peer = tl.load(buffers_ptr + q).to(tl.pointer_type(dtype))
                tl.store(peer + base + RANK * segment + row * dim + cols, x, mask=here)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(ITERS):
        row = i * STEP + pid
        here = mask & (row < rows)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            if q == RANK:
                acc += _sent(x_ptr, row, dim, cols, here).to(tl.float32)
            else:
                at = mine + base + q * segment + row * dim + cols
                acc += _arrived(at, here, BITS).to(tl.float32)
        r = tl.load(r_ptr + row * dim + cols, mask=here, other=0.0)
        # As the two ops round: the sum to the dtype, then the add, then the norm.
        t = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(total_ptr + row * dim + cols, t, mask=here)
        h = t.to(tl.float32)
        var = tl.sum(h * h, axis=0) / dim
        y = (h * tl.rsqrt(var + eps)).to(dtype)
        out = w * y.to(tl.float32)
        tl.store(out_ptr + row * dim + cols, out.to(out_ptr.dtype.element_ty), mask=here)
    tl.store(slots_ptr + pid, (slot + 1) % NSLOTS)


def buffer_elements(rows: int, dim: int, world: int) -> int:
    """Elements of each rank's buffer for calls of up to ``rows`` rows of ``dim``."""
    return SLOTS * world * rows * dim


def all_reduce_add_norm_rows(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    total: torch.Tensor,
    buffers: torch.Tensor,
    slots: torch.Tensor,
    segment: int,
    rank: int,
    world: int,
    pdl: bool = False,
) -> None:
    """``total[r] = sum over ranks of x[r] + residual[r]`` and ``out[r] = weight *
    rms_norm(total[r])`` for every row of the contiguous 2-D ``x``, on every rank of the
    group at once (a collective: every rank calls it with the same shapes). ``buffers``:
    an int64 device table of each rank's buffer (``buffer_elements`` of ``segment`` /
    ``dim`` rows, every element ``SENTINEL`` before the first call, as each call leaves
    it); ``slots``: int32 ``[PROGRAMS]``, zero at first. ``pdl``: launch with programmatic
    dependent launch where ``pdl_for`` allows it for this many rows."""
    rows, dim = x.shape
    pdl = pdl_for(pdl, rows)
    if rows * dim > segment:
        raise ValueError(f"all_reduce_add_norm_rows: {rows} rows of {dim} exceed the buffer")
    if x.element_size() not in (2, 4):
        raise ValueError(f"all_reduce_add_norm_rows: no sentinel for {x.dtype}")
    block = triton.next_power_of_2(dim)
    launch(
        _all_reduce_add_norm_kernel, (PROGRAMS,), x, residual, weight, out, total,
        buffers, slots, rows, dim, segment, eps,
        RANK=rank, WORLD=world, BITS=8 * x.element_size(), BLOCK=block, STEP=PROGRAMS,
        ITERS=triton.cdiv(rows, PROGRAMS), NSLOTS=SLOTS, USE_PDL=pdl_arg(pdl),
        num_warps=min(16, max(1, block // 256)), launch_pdl=pdl,
    )  # fmt: skip
