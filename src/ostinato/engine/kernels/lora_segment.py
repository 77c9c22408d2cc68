"""Each row's LoRA expand inside the small GEMM, before its epilogue: the *segment*.

A LoRA decode step of the QKV or gate/up group has each row's shrink ready before its
projection (the norm before it computed ``s = h @ A_slot.T``, ``kernels.rms_norm``'s
shrink). The projection's programs then add ``s[m] @ B_slot[:, their columns]`` to their
float32 sums before the epilogue (RoPE and the K/V write, or SiLU·mul) rounds them: the
expand needs no kernel of its own. A program loads its rows' slots before the PDL wait
(no kernel of the step writes them) and their shrinks right after it, both before its K
loop, so that neither round trip lengthens the kernel's tail. After the loop, for each
adapter slot, it multiplies that slot's rows of ``s`` (the other rows zeroed) by its
``W`` rows of B at the program's columns: tensor cores where the GEMM's row tile is 16
(``DOT``), a product summed on CUDA cores for the resident launch's few rows. The slots
are a loop without a branch, B's loads masked off for a slot no row uses (they read
nothing): with a branch per slot around its load, a LoRA step of the 1.5 B shape at 8
rows took 1.188 ms against 1.125 (H200).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class LoraSegment:
    """A projection's LoRA expand for its rows: row ``i`` adds ``s[i] @ b[W * slots[i] :
    W * (slots[i] + 1)]`` (``W = b.shape[0] // max_loras``) to its output columns, nothing
    where its slot is -1. ``s`` ``[rows, W]``: each row's shrink by its own slot; ``b``
    ``[max_loras * W, out]`` (every slot's B, scaled, in the projection's output
    columns); ``slots`` int64, at least a slot per row."""

    s: torch.Tensor
    b: torch.Tensor
    slots: torch.Tensor
    max_loras: int

    @property
    def width(self) -> int:
        """``W``: the rows of B (and columns of ``s``) a slot has."""
        return self.b.shape[0] // self.max_loras


def segment_args(
    segment: LoraSegment | None, x: torch.Tensor, n_out: int, resident: bool
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int], dict[str, int]]:
    """The GEMM kernel's segment pointers and strides (``x`` and zeros where none) and
    its constexprs, after checking ``segment`` fits ``x``'s rows and ``n_out`` output
    columns (the projection's weight rows). Tensor cores (``LORA_DOT``) for 16-bit rows
    in a 16-row tile, not a resident launch's few rows, nor float32 (TF32 would round)."""
    if segment is None:
        return (x, x, x, 0, 0), {"LORA_W": 0, "LORA_W_PAD": 16, "MAX_LORAS": 1, "LORA_DOT": 0}
    s, b, slots, width = segment.s, segment.b, segment.slots, segment.width
    fits = (
        b.shape[0] == segment.max_loras * width
        and b.shape[1] == n_out
        and s.shape == (x.shape[0], width)
        and slots.shape[0] >= x.shape[0]
    )
    if not fits or s.stride(-1) != 1 or b.stride(-1) != 1 or slots.dtype != torch.int64:
        raise ValueError(
            f"small_gemm: a LoRA segment of s {tuple(s.shape)}, b {tuple(b.shape)}, slots "
            f"{tuple(slots.shape)} {slots.dtype} does not fit {x.shape[0]} rows of {n_out} "
            "columns: needs s [rows, W], b [max_loras * W, out] (rows contiguous), int64 "
            "slots, one a row"
        )
    constants = {
        "LORA_W": width,
        "LORA_W_PAD": max(16, triton.next_power_of_2(width)),
        "MAX_LORAS": segment.max_loras,
        "LORA_DOT": int(not resident and s.dtype != torch.float32),
    }
    return (s, b, slots, s.stride(0), b.stride(0)), constants


@triton.jit
def _add(acc, s, b, DOT: tl.constexpr):
    """``acc + s @ b`` in float32 (``s`` ``[M, W_PAD]``, ``b`` ``[W_PAD, N]``)."""
    if DOT:
        acc = tl.dot(s, b, acc)
    else:
        acc += tl.sum(s.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return acc


@triton.jit
def lora_slots(slots_ptr, rm, M, LIVE):
    """Each row's adapter slot (-1 for rows past ``M``, and for every row unless
    ``LIVE``: those load nothing)."""
    return tl.load(slots_ptr + rm, mask=(rm < M) & LIVE, other=-1)


@triton.jit
def lora_shrunk(s_ptr, rm, slots, stride_s, W: tl.constexpr, W_PAD: tl.constexpr):
    """The rows' shrinks ``[rows, W_PAD]`` (zeros where a row has no slot, and past ``W``)."""
    w = tl.arange(0, W_PAD)
    mask = (slots >= 0)[:, None] & (w < W)[None, :]
    return tl.load(s_ptr + rm[:, None] * stride_s + w[None, :], mask=mask, other=0.0)


@triton.jit
def _slot_add(
    acc, acc2, s, slots, b_ptr, rn, N, OFF2, stride_b, j, TWO: tl.constexpr, W: tl.constexpr,
    W_PAD: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """``acc`` (and with ``TWO`` ``acc2``, at columns ``rn + OFF2``) plus slot ``j``'s rows
    of ``s`` times its B rows; B is read only where some row uses slot ``j``."""
    mine = slots == j
    used = tl.max(mine.to(tl.int32), axis=0) > 0
    sj = tl.where(mine[:, None], s, tl.zeros_like(s))
    w = tl.arange(0, W_PAD)
    mask = (w < W)[:, None] & (rn < N)[None, :] & used
    ptrs = b_ptr + (j * W + w)[:, None] * stride_b + rn[None, :]
    acc = _add(acc, sj, tl.load(ptrs, mask=mask, other=0.0), DOT)
    if TWO:
        acc2 = _add(acc2, sj, tl.load(ptrs + OFF2, mask=mask, other=0.0), DOT)
    return acc, acc2


@triton.jit
def lora_segment(
    acc, acc2, s, slots, b_ptr, rn, N, OFF2, stride_b, TWO: tl.constexpr, W: tl.constexpr,
    W_PAD: tl.constexpr, MAX_LORAS: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """``acc`` (columns ``rn``) plus each row's ``s @ B_slot`` (``s`` and ``slots`` as
    ``lora_shrunk`` and ``lora_slots`` loaded them), and with ``TWO`` ``acc2`` plus the
    same at columns ``rn + OFF2`` (see the module docstring)."""
    for j in range(MAX_LORAS):  # (a loop: unrolled, the step measured slower at one row)
        acc, acc2 = _slot_add(
            acc, acc2, s, slots, b_ptr, rn, N, OFF2, stride_b, j, TWO, W, W_PAD, DOT
        )
    return acc, acc2
