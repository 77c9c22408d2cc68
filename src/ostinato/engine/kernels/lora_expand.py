"""The LoRA expand of a few rows in one kernel, each row gathering its own slot's B.

For decode steps (at most ``MAX_ROWS`` rows) ``LoraProjection.project``'s one GEMM over
the joint weight yields every slot's shrink beside the projection (``s = x @ a.T``,
``[rows, max_loras * W]``), then this kernel runs instead of the dense path's mask
multiply and expand GEMM (two kernels): a program
per (row, block of output columns) reads the row's slot, its ``W`` entries of ``s`` and
the slot's ``W`` rows of ``B`` for its columns, and writes ``y + s_slot @ B_slot`` in
place, accumulated in float32 and rounded once, as the expand GEMM does. A row without a
slot (-1) writes nothing. No program walks ``K``: the shrink did, once, in the GEMM.

With ``swiglu`` (the gate/up group) the kernel also applies SiLU·mul, the next kernel of
the unfused MLP: each program takes a block of gate columns and the same block of up
columns, rounds ``y + delta`` of each to the input dtype (as the unfused path stores
them) and writes ``silu(gate) * up`` to a new tensor, for every row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.launch import launch, pdl_arg, pdl_for
from ostinato.engine.kernels.pdl import pdl_enter

# (the QKV projection's ROPE_KV epilogue has one home: the small GEMM's)
from ostinato.engine.kernels.small_gemm import (
    RopeKV,
    _rope_args,
    _rope_inputs,
    _rope_kv_epilogue,
    rope_head_dim,
)

MAX_ROWS = 16  # decode steps; larger steps take the dense path (B is read once a row)
BLOCK_N = 128


@triton.jit
def _slot_b(b_ptr, rows, w_ok, cols, c_ok, stride_b):
    """The slot's ``B[rows]`` at ``cols`` in float32 (zero where a mask is off)."""
    b = tl.load(
        b_ptr + rows[:, None] * stride_b + cols[None, :],
        mask=w_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    return b.to(tl.float32)


@triton.jit
def _lora_expand_kernel(
    y_ptr, s_ptr, b_ptr, slots_ptr, out_ptr, N, stride_y, stride_s, stride_b, stride_out,
    W: tl.constexpr, W_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr,
    IN_PLACE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # The slot and its B come first, before the PDL wait: no kernel of the step writes
    # them (``row_slots`` and the slots are written before the step), so their loads
    # overlap the joint GEMM's tail; y and s are that GEMM's, read after the wait.
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    valid = slot >= 0  # (a row without a slot loads no B)
    w = tl.arange(0, W_PAD)
    w_ok = (w < W) & valid
    rows = tl.maximum(slot, 0) * W + w
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < N  # (N: the output's columns; with SWIGLU half of B's)
    b = _slot_b(b_ptr, rows, w_ok, cols, c_ok, stride_b)
    if SWIGLU:
        b_up = _slot_b(b_ptr, rows, w_ok, cols + N, c_ok, stride_b)
    pdl_enter(USE_PDL)
    s = tl.load(s_ptr + row * stride_s + rows, mask=w_ok, other=0.0).to(tl.float32)
    delta = tl.sum(b * s[:, None], axis=0)
    y = tl.load(y_ptr + row * stride_y + cols, mask=c_ok, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    if SWIGLU:
        up_delta = tl.sum(b_up * s[:, None], axis=0)
        up = tl.load(y_ptr + row * stride_y + N + cols, mask=c_ok, other=0.0).to(tl.float32)
        gate = (y + delta).to(dtype).to(tl.float32)
        up = (up + up_delta).to(dtype).to(tl.float32)
        act = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * stride_out + cols, act.to(dtype), mask=c_ok)
    elif IN_PLACE:
        tl.store(y_ptr + row * stride_y + cols, (y + delta).to(dtype), mask=c_ok & valid)
    else:  # (every row: out is a new tensor)
        tl.store(out_ptr + row * stride_out + cols, (y + delta).to(dtype), mask=c_ok)


@triton.jit
def _expand_qkv_kernel(
    y_ptr, s_ptr, b_ptr, slots_ptr, q_ptr, cos_ptr, sin_ptr, kv_slot_ptr, kc_ptr, vc_ptr,
    qn_ptr, kn_ptr, stride_y, stride_s, stride_b, stride_q, stride_rt, stride_cs, stride_ch,
    Q_HEADS, KV_HEADS, eps, W: tl.constexpr, W_PAD: tl.constexpr, HALF: tl.constexpr,
    QK_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # A program per (row, head): the head's two halves of ``y + s_slot @ B_slot``, rounded
    # as ``lora_expand`` stores them, then what the QKV GEMM's ROPE_KV epilogue does with
    # a head. B and the LoRA slot first, before the PDL wait (``_lora_expand_kernel``);
    # RoPE's tables and the cache slots after it (a kernel of the step writes them).
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    w = tl.arange(0, W_PAD)
    w_ok = (w < W) & (slot >= 0)
    rows = tl.maximum(slot, 0) * W + w
    cols = head * 2 * HALF + tl.arange(0, HALF)
    live = cols >= 0  # (every column of a head is live)
    b_a = _slot_b(b_ptr, rows, w_ok, cols, live, stride_b)
    b_b = _slot_b(b_ptr, rows, w_ok, cols + HALF, live, stride_b)
    pdl_enter(USE_PDL)
    rm = row + tl.arange(0, 1)  # (the epilogue's tile of rows: this one)
    ca, cb, sa, sb, kv_slot = _rope_inputs(
        rm, row + 1, head, 0, cos_ptr, sin_ptr, stride_rt, kv_slot_ptr, Q_HEADS, KV_HEADS,
        HALF, HALF,
    )  # fmt: skip
    s = tl.load(s_ptr + row * stride_s + rows, mask=w_ok, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    a = tl.load(y_ptr + row * stride_y + cols).to(tl.float32) + tl.sum(b_a * s[:, None], axis=0)
    b = tl.load(y_ptr + row * stride_y + cols + HALF).to(tl.float32)
    b += tl.sum(b_b * s[:, None], axis=0)
    a = a.to(dtype).to(tl.float32)[None, :]
    b = b.to(dtype).to(tl.float32)[None, :]
    _rope_kv_epilogue(
        a, b, rm, row + 1, head, 0, q_ptr, stride_q, ca, cb, sa, sb, kv_slot, kc_ptr, vc_ptr,
        stride_cs, stride_ch, qn_ptr, kn_ptr, eps, Q_HEADS, KV_HEADS, QK_NORM, HALF, HALF,
    )  # fmt: skip


def lora_expand_qkv(
    y: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    max_loras: int,
    rope: RopeKV,
    out: torch.Tensor,
    pdl: bool = False,
) -> torch.Tensor:
    """The QKV group's expand ending as ``small_gemm.qkv_rope_kv`` ends, in one kernel:
    of each row's ``y + s_slot @ B_slot`` (``lora_expand``'s operands and sum, rounded to
    ``y``'s dtype), the query heads (QK-normed, unrotated) into ``out`` (``[rows, q_heads
    * d]``, any row stride) and the keys (QK-normed, rotated) and values into
    ``rope``'s caches at its slots; returns ``out``. So a LoRA step's K/V write is no
    kernel of its own. ``d``: a power of two >= 32."""
    n, width = y.shape[0], b.shape[0] // max_loras
    d = rope.k_cache.shape[-1]
    heads = rope.q_heads + 2 * rope.kv_heads
    if n > MAX_ROWS or y.shape[1] != heads * d or b.shape[1] != y.shape[1]:
        raise ValueError(
            f"lora_expand_qkv: y {tuple(y.shape)}, b {tuple(b.shape)}: needs at most "
            f"{MAX_ROWS} rows of {heads} heads of {d}"
        )
    if s.shape != (n, b.shape[0]) or not rope_head_dim(d):
        raise ValueError(f"lora_expand_qkv: s {tuple(s.shape)}, head dim {d}: see lora_expand")
    if out.shape != (n, rope.q_heads * d) or out.stride(-1) != 1:
        raise ValueError(f"lora_expand_qkv: out must be [{n}, {rope.q_heads * d}], rows contiguous")
    if n == 0:
        return out
    tensors, ints, eps = _rope_args(y, rope, rope.eps)
    pdl = pdl_for(pdl, n)
    launch(
        _expand_qkv_kernel, (n, heads), y, s, b, slots, out, *tensors, y.stride(0),
        s.stride(0), b.stride(0), out.stride(0), *ints, eps, W=width,
        W_PAD=triton.next_power_of_2(width), HALF=d // 2, QK_NORM=rope.q_norm is not None,
        USE_PDL=pdl_arg(pdl), num_warps=2, launch_pdl=pdl,
    )  # fmt: skip
    return out


def lora_expand(
    y: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    max_loras: int,
    swiglu: bool = False,
    in_place: bool = True,
    pdl: bool = False,
) -> torch.Tensor:
    """``y[i] += s[i, slot rows] @ b[slot rows]`` in place for each row ``i`` with
    ``slots[i] >= 0`` (``s`` ``[rows, max_loras * W]``, every slot's shrink; ``b``
    ``[max_loras * W, N]``; ``slots`` at least ``y``'s rows, int64); returns ``y``.
    Without ``in_place``: the sum in a new contiguous tensor, ``y`` (any row stride) left
    as it was. With ``swiglu``: returns a new ``silu(g) * u`` (``[rows, N / 2]``) of the
    gate and up halves of that sum, each rounded to ``y``'s dtype first. ``pdl``: launched
    with programmatic dependent launch where ``pdl_for`` allows (its launch overlaps the
    GEMM before it, as the base step's kernels do)."""
    n, width = y.shape[0], b.shape[0] // max_loras
    if n > MAX_ROWS or y.shape[1] != b.shape[1] or s.shape != (n, b.shape[0]):
        raise ValueError(
            f"lora_expand: y {tuple(y.shape)}, s {tuple(s.shape)}, b {tuple(b.shape)}: "
            f"needs at most {MAX_ROWS} rows, y [rows, N], s [rows, b's rows]"
        )
    if y.stride(-1) != 1 or s.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("lora_expand: every operand needs a contiguous last dimension")
    cols = b.shape[1] // 2 if swiglu else b.shape[1]
    fresh = swiglu or not in_place
    out = torch.empty((n, cols), dtype=y.dtype, device=y.device) if fresh else y
    pdl = pdl_for(pdl, n)
    launch(
        _lora_expand_kernel, (n, triton.cdiv(cols, BLOCK_N)), y, s, b, slots, out, cols,
        y.stride(0), s.stride(0), b.stride(0), out.stride(0),
        W=width, W_PAD=triton.next_power_of_2(width), BLOCK_N=BLOCK_N, SWIGLU=swiglu,
        IN_PLACE=not fresh, USE_PDL=pdl_arg(pdl), num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out
