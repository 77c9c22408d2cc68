"""The RMSNorm kernel behind ``ostinato::rms_norm``, ``ostinato::add_rms_norm`` and
``ostinato::lora_add_rms_norm`` on CUDA: one program per row, the whole row in
registers, so a norm (with the residual add before it, and a row's LoRA expand before
that) is one launch at any row count."""

from __future__ import annotations

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
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    LORA_W: tl.constexpr,
    LORA_W_PAD: tl.constexpr,
    LORA_AHEAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    if LORA_AHEAD:
        # The row's slot and its B rows before the wait: no kernel of the step writes
        # them (``row_slots`` and the slots are written before it), so their read
        # overlaps the previous kernel's tail; ``s`` is that kernel's, read after.
        b, first, w_ok = _slot_b(b_ptr, slots_ptr, row, cols, mask, stride_b, LORA_W, LORA_W_PAD)
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
        tl.store(total_ptr + row * stride_t + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / dim
    y = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)  # back to the input dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_rows(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    total: torch.Tensor | None,
    pdl: bool = False,
    delta: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> None:
    """``out[r] = weight * rms_norm(x[r] (+ residual[r]))`` for every row of the 2-D
    ``x`` (any row stride); with ``residual``, ``total[r] = x[r] + residual[r]`` too.
    ``pdl``: launch with programmatic dependent launch (compute capability 9.0+) when
    ``pdl_for`` allows it for this many rows. ``delta`` (``s``, ``b``, ``slots``,
    ``max_loras``): each row's LoRA expand added to ``x`` first, ``s[i, W * slots[i] : W *
    (slots[i] + 1)] @ b[those rows]`` with ``W = b.shape[0] // max_loras`` (nothing where
    the slot is -1), in float32, the sum rounded to ``x``'s dtype as ``kernels.lora_expand``
    writes it; ``s`` ``[rows, b's rows]`` (every slot's shrink), ``slots`` int64."""
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
    launch(
        _rms_norm_kernel,
        (rows,),
        x,
        r,
        weight,
        out,
        t,
        x.stride(0),
        r.stride(0),
        out.stride(0),
        t.stride(0),
        dim,
        eps,
        *lora,
        ADD=add,
        BLOCK=block,
        USE_PDL=pdl_arg(pdl),
        LORA_W=width,
        LORA_W_PAD=triton.next_power_of_2(max(width, 1)),
        LORA_AHEAD=loads_b_ahead(width, block, warps),
        num_warps=warps,
        launch_pdl=pdl,
    )


def loads_b_ahead(width: int, block: int, warps: int) -> bool:
    """Whether a program loads its row's ``width`` B rows (of ``block`` columns) before the
    PDL wait: where each of its ``warps * 32`` threads holds ``AHEAD_PER_THREAD`` of
    their elements at most."""
    per_thread = triton.next_power_of_2(max(width, 1)) * block // (32 * warps)
    return 0 < width and per_thread <= AHEAD_PER_THREAD


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
