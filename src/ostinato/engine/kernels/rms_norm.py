"""The RMSNorm kernel behind ``ostinato::rms_norm``, ``ostinato::add_rms_norm`` and
``ostinato::lora_add_rms_norm`` on CUDA: one program per row, the whole row in
registers, so a norm (with the residual add before it, and a row's LoRA expand before
that) is one launch at any row count. With a LoRA shrink after it (``Shrink``, the next
projection's ``h @ A_slot.T``), a few programs per row, each computing the row's norm
and a few of the shrink's columns; the first stores the row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.launch import launch, pdl_arg, pdl_for
from ostinato.engine.kernels.pdl import pdl_enter

# A LoRA delta's B rows load before the PDL wait where a thread holds at most this many
# of their elements: rank 16 on the 1.5 B shape (8 warps) and the 8 B shape (16 warps,
# so at most 128 registers a thread) compile for sm_90a to 96 registers without a spill,
# launched as the engine launches them (``scripts/kernel_registers.py``'s
# ``launched_registers``: Triton's alignment hints; a compile without them spilled).
AHEAD_PER_THREAD = 128
# A program with a shrink holds its few rows of the next projection's A before the wait
# too, at most this many elements a thread (so several programs share a row's shrink).
SHRINK_PER_THREAD = 64


@triton.jit
def _slot_b(b_ptr, slots_ptr, row, cols, mask, stride_b, W: tl.constexpr, W_PAD: tl.constexpr):
    """The row's slot's ``W`` rows of B at ``cols`` (``[W_PAD, BLOCK]``, zero where masked
    or the row has no slot), the slot's first row and which of the ``W_PAD`` are live."""
    slot = tl.load(slots_ptr + row)
    w = tl.arange(0, W_PAD)
    w_ok = (w < W) & (slot >= 0)  # (a row without a slot adds zero)
    first = tl.maximum(slot, 0) * W
    ptrs = b_ptr + (first + w)[:, None] * stride_b + cols[None, :]
    return tl.load(ptrs, mask=w_ok[:, None] & mask[None, :], other=0.0), first, w_ok


@triton.jit
def _slot_a(
    a_ptr, slots_ptr, row, chunk, cols, mask, stride_a, W: tl.constexpr, CHUNK: tl.constexpr
):
    """Rows ``chunk * CHUNK ...`` of the row's slot's ``W`` rows of A at ``cols`` (zero
    where masked or the row has no slot) and which of the ``CHUNK`` are the slot's."""
    slot = tl.load(slots_ptr + row)
    w = chunk * CHUNK + tl.arange(0, CHUNK)
    w_ok = w < W
    live = w_ok & (slot >= 0)  # (a row without a slot shrinks to zero)
    ptrs = a_ptr + (tl.maximum(slot, 0) * W + w)[:, None] * stride_a + cols[None, :]
    return tl.load(ptrs, mask=live[:, None] & mask[None, :], other=0.0), w_ok


@triton.jit
def _delta_by_row(
    s_ptr, b_ptr, slots_ptr, row, cols, mask, stride_s, stride_b, W: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """The row's float32 delta, its slot's B rows loaded one at a time."""
    slot = tl.load(slots_ptr + row)
    valid = slot >= 0
    first = tl.maximum(slot, 0) * W
    delta = tl.zeros([BLOCK], dtype=tl.float32)
    for w in tl.static_range(W):
        sw = tl.load(s_ptr + row * stride_s + first + w, mask=valid, other=0.0)
        bw = tl.load(b_ptr + (first + w) * stride_b + cols, mask=mask & valid, other=0.0)
        delta += sw.to(tl.float32) * bw.to(tl.float32)
    return delta


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    total_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_t,
    dim,
    eps,
    s_ptr,
    b_ptr,
    slots_ptr,
    stride_s,
    stride_b,
    a_ptr,
    shrunk_ptr,
    stride_a,
    stride_shrunk,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    LORA_W: tl.constexpr,
    LORA_W_PAD: tl.constexpr,
    LORA_AHEAD: tl.constexpr,
    SHRINK_W: tl.constexpr,
    SHRINK_CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)  # (with SHRINK_W: which SHRINK_CHUNK of the shrink's columns)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    if LORA_AHEAD:
        # The row's slot and its B rows before the wait: no kernel of the step writes
        # them (``row_slots`` and the slots are written before it), so their read
        # overlaps the previous kernel's tail; ``s`` is that kernel's, read after.
        b, first, w_ok = _slot_b(b_ptr, slots_ptr, row, cols, mask, stride_b, LORA_W, LORA_W_PAD)
    if SHRINK_W > 0:  # this program's rows of the next projection's A, before the wait too
        a, a_ok = _slot_a(
            a_ptr, slots_ptr, row, chunk, cols, mask, stride_a, SHRINK_W, SHRINK_CHUNK
        )
    pdl_enter(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if LORA_W > 0:  # x + s[row, its slot's W columns] @ b[those W rows], rounded once
        if LORA_AHEAD:
            sw = tl.load(
                s_ptr + row * stride_s + first + tl.arange(0, LORA_W_PAD), mask=w_ok, other=0.0
            )
            delta = tl.sum(b.to(tl.float32) * sw.to(tl.float32)[:, None], axis=0)
        else:  # (too many of B's rows to hold at once: one at a time)
            delta = _delta_by_row(
                s_ptr, b_ptr, slots_ptr, row, cols, mask, stride_s, stride_b, LORA_W, BLOCK
            )
        x = (x.to(tl.float32) + delta).to(x_ptr.dtype.element_ty)
    if ADD:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # as x + r
        tl.store(total_ptr + row * stride_t + cols, x, mask=mask & (chunk == 0))
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / dim
    y = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)  # back to the input dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask & (chunk == 0))
    if SHRINK_W > 0:  # the stored row times A, summed in float32 and rounded once
        part = tl.sum(a.to(tl.float32) * out.to(tl.float32)[None, :], axis=1)
        at = chunk * SHRINK_CHUNK + tl.arange(0, SHRINK_CHUNK)
        part = part.to(out_ptr.dtype.element_ty)
        tl.store(shrunk_ptr + row * stride_shrunk + at, part, mask=a_ok)


@dataclass(frozen=True)
class Shrink:
    """The next projection's LoRA shrink, computed from each normed row as it is stored:
    ``out[i] = norm_out[i] @ a[W * slots[i] : W * (slots[i] + 1)].T`` (``W = a.shape[0] //
    max_loras``; zeros where the slot is -1), summed in float32 and rounded once to the
    rows' dtype. ``a`` ``[max_loras * W, dim]`` (every slot's A), ``out`` ``[rows, W]``
    (rows contiguous), ``slots`` int64, at least a slot per row."""

    a: torch.Tensor
    out: torch.Tensor
    slots: torch.Tensor
    max_loras: int


def rms_norm_rows(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    total: torch.Tensor | None,
    pdl: bool = False,
    delta: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
    shrink: Shrink | None = None,
) -> None:
    """``out[r] = weight * rms_norm(x[r] (+ residual[r]))`` for every row of the 2-D
    ``x`` (any row stride); with ``residual``, ``total[r] = x[r] + residual[r]`` too.
    ``pdl``: launch with programmatic dependent launch (compute capability 9.0+) when
    ``pdl_for`` allows it for this many rows. ``delta`` (``s``, ``b``, ``slots``,
    ``max_loras``): each row's LoRA expand added to ``x`` first, ``s[i, W * slots[i] : W *
    (slots[i] + 1)] @ b[those rows]`` with ``W = b.shape[0] // max_loras`` (nothing where
    the slot is -1), in float32, the sum rounded to ``x``'s dtype as ``kernels.lora_expand``
    writes it; ``s`` ``[rows, b's rows]`` (every slot's shrink), ``slots`` int64.
    ``shrink``: the next projection's LoRA shrink of each row of ``out`` too (``Shrink``;
    several programs a row then, each with a few of its columns)."""
    rows, dim = x.shape
    if rows == 0:
        return
    pdl = pdl_for(pdl, rows)
    if x.stride(-1) != 1:
        x = x.contiguous()
    add = residual is not None and total is not None
    if add and residual.stride(-1) != 1:
        residual = residual.contiguous()
    r = residual if add else x
    t = total if add else out
    block = triton.next_power_of_2(dim)
    lora = _lora_args(delta, x, dim)
    width = delta[1].shape[0] // delta[3] if delta is not None else 0
    warps = min(16, max(1, block // 256))
    shrink_args, shrink_w, chunk = _shrink_args(shrink, x, dim, block, warps)
    if shrink is not None and delta is None:  # (the kernel reads the slots from the delta's)
        lora = (x, x, shrink.slots, 0, 0)
    elif shrink is not None and shrink.slots.data_ptr() != lora[2].data_ptr():
        raise ValueError("rms_norm_rows: a delta and a shrink read one tensor of slots")
    launch(
        _rms_norm_kernel, (rows, max(1, triton.cdiv(shrink_w, chunk))), x, r, weight, out, t,
        x.stride(0), r.stride(0), out.stride(0), t.stride(0), dim, eps, *lora, *shrink_args,
        ADD=add, BLOCK=block, USE_PDL=pdl_arg(pdl), LORA_W=width,
        LORA_W_PAD=triton.next_power_of_2(max(width, 1)),
        LORA_AHEAD=loads_b_ahead(width, block, warps), SHRINK_W=shrink_w, SHRINK_CHUNK=chunk,
        num_warps=warps, launch_pdl=pdl,
    )  # fmt: skip


def loads_b_ahead(width: int, block: int, warps: int) -> bool:
    """Whether a program loads its row's ``width`` B rows (of ``block`` columns) before the
    PDL wait: where each of its ``warps * 32`` threads holds ``AHEAD_PER_THREAD`` of
    their elements at most."""
    per_thread = triton.next_power_of_2(max(width, 1)) * block // (32 * warps)
    return 0 < width and per_thread <= AHEAD_PER_THREAD


def _shrink_args(
    shrink: Shrink | None, x: torch.Tensor, dim: int, block: int, warps: int
) -> tuple[tuple[torch.Tensor, torch.Tensor, int, int], int, int]:
    """The kernel's ``a`` and shrink output with their row strides (``x`` in their place
    without a shrink), the shrink's width and its columns per program: as many as keep
    a thread's share of the program's A rows within ``SHRINK_PER_THREAD`` elements."""
    if shrink is None:
        return (x, x, 0, 0), 0, 1
    a, out, slots, max_loras = shrink.a, shrink.out, shrink.slots, shrink.max_loras
    width = a.shape[0] // max_loras
    fits = a.shape == (max_loras * width, dim) and out.shape == (x.shape[0], width)
    if not fits or slots.shape[0] < x.shape[0] or a.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(
            f"rms_norm_rows: a LoRA shrink of a {tuple(a.shape)} into {tuple(out.shape)} "
            f"does not fit {x.shape[0]} rows of {dim}: needs a [max_loras * W, dim], out "
            "[rows, W] (rows contiguous) and a slot per row"
        )
    fit = max(1, SHRINK_PER_THREAD * 32 * warps // block)
    chunk = min(triton.next_power_of_2(width), 1 << (fit.bit_length() - 1))
    return (a, out, a.stride(0), out.stride(0)), width, chunk


def _lora_args(
    delta: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None, x: torch.Tensor, dim: int
) -> tuple:
    """The kernel's ``s``, ``b``, ``slots`` and their row strides (``x`` in their place,
    unread, without a delta)."""
    if delta is None:
        return x, x, x, 0, 0
    s, b, slots, max_loras = delta
    if s.shape != (x.shape[0], b.shape[0]) or b.shape[1] != dim or slots.shape[0] < x.shape[0]:
        raise ValueError(
            f"rms_norm_rows: a LoRA delta of s {tuple(s.shape)}, b {tuple(b.shape)}, slots "
            f"{tuple(slots.shape)} does not fit {x.shape[0]} rows of {dim}: needs s [rows, "
            "b's rows], b [max_loras * W, dim] and a slot per row"
        )
    if s.stride(-1) != 1 or b.stride(-1) != 1 or b.shape[0] % max_loras:
        raise ValueError("rms_norm_rows: s and b need contiguous rows, b max_loras * W of them")
    return s, b, slots, s.stride(0), b.stride(0)
