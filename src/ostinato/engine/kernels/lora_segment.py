"""Each row's LoRA expand inside the small GEMM, before its epilogue: the *segment*.

A LoRA decode step of the QKV or gate/up group has each row's shrink ready before its
projection (the norm before it computed ``s = h @ A_slot.T``, ``kernels.rms_norm``'s
shrink). The projection's programs then add ``s[m] @ B_slot[:, their columns]`` to their
float32 sums before the epilogue (RoPE and the K/V write, or SiLU·mul) rounds them: the
expand needs no kernel of its own. A program loops over the adapter slots and, for each
slot some row of the step uses, multiplies that slot's rows of ``s`` (the other rows
zeroed) by its ``W`` rows of B at the program's columns: tensor cores where the GEMM's
row tile is 16 (``DOT``), a product summed on CUDA cores for the resident launch's few
rows. Slots no row uses cost a load of the row slots and a comparison; B is read only
for the slots in use, as the separate expand kernel read it.
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
    columns); ``slots`` int64, at least a slot per row. A slot's ``W`` rows are its
    members' (``model.lora``'s layout): member ``m``'s ``rank`` rows (``m * rank`` on)
    are zero outside its columns, which begin at ``starts[m]`` (``starts[0] == 0``); a
    program reads only its columns' member's rows."""

    s: torch.Tensor
    b: torch.Tensor
    slots: torch.Tensor
    max_loras: int
    rank: int
    starts: tuple[int, ...]

    @property
    def width(self) -> int:
        """``W``: the rows of B (and columns of ``s``) a slot has."""
        return self.b.shape[0] // self.max_loras


def segment_args(
    segment: LoraSegment | None, x: torch.Tensor, n_out: int, tile: int, resident: bool
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int, int], dict[str, int]]:
    """The GEMM kernel's segment pointers, strides and the starts of members 1 and 2
    (``x`` and zeros where none) and its constexprs, after checking ``segment`` fits
    ``x``'s rows and ``n_out`` output columns (the projection's weight rows) in programs
    of ``tile`` columns (no program's columns span two members). Tensor cores
    (``LORA_DOT``) for 16-bit rows in a 16-row tile, not a resident launch's few rows,
    nor float32 (TF32 would round)."""
    if segment is None:
        none = {"LORA_W": 0, "LORA_R": 1, "LORA_R_PAD": 16, "MAX_LORAS": 1, "LORA_DOT": 0}
        return (x, x, x, 0, 0, 0, 0), none
    s, b, slots, width, rank = segment.s, segment.b, segment.slots, segment.width, segment.rank
    starts = segment.starts
    fits = (
        b.shape[0] == segment.max_loras * width
        and b.shape[1] == n_out
        and s.shape == (x.shape[0], width)
        and slots.shape[0] >= x.shape[0]
        and width == len(starts) * rank
        and len(starts) <= 3
        and starts[0] == 0
        and all(start % tile == 0 for start in starts)
    )
    if not fits or s.stride(-1) != 1 or b.stride(-1) != 1 or slots.dtype != torch.int64:
        raise ValueError(
            f"small_gemm: a LoRA segment of s {tuple(s.shape)}, b {tuple(b.shape)}, slots "
            f"{tuple(slots.shape)} {slots.dtype}, members at {starts} of rank {rank} does "
            f"not fit {x.shape[0]} rows of {n_out} columns in tiles of {tile}: needs s [rows, "
            "W], b [max_loras * W, out] (rows contiguous), W = rank a member (at most 3, the "
            "first at 0, each at a tile's first column), int64 slots, one a row"
        )
    later = [*starts[1:], n_out, n_out][:2]
    constants = {"LORA_W": width, "LORA_R": rank, "MAX_LORAS": segment.max_loras}
    constants["LORA_R_PAD"] = max(16, triton.next_power_of_2(rank))
    constants["LORA_DOT"] = int(not resident and s.dtype != torch.float32)
    return (s, b, slots, s.stride(0), b.stride(0), *later), constants


@triton.jit
def _add(acc, s, b, DOT: tl.constexpr):
    """``acc + s @ b`` in float32 (``s`` ``[M, R_PAD]``, ``b`` ``[R_PAD, N]``)."""
    if DOT:
        acc = tl.dot(s, b, acc)
    else:
        acc += tl.sum(s.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return acc


@triton.jit
def _member(col, start1, start2):
    """The member whose output columns hold ``col`` (0, 1 or 2)."""
    return (col >= start1).to(tl.int32) + (col >= start2).to(tl.int32)


@triton.jit
def _expand(
    acc, s_ptr, b_ptr, slots, rm, rn, col, live, N, stride_s, stride_b, start1, start2,
    W: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr, MAX_LORAS: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    """``acc`` plus each row's ``s @ B_slot`` at columns ``rn`` (``col``: their first,
    whose member's rows alone are read)."""
    first = _member(col, start1, start2) * R
    r = tl.arange(0, R_PAD)
    r_ok = r < R
    s = tl.load(
        s_ptr + rm[:, None] * stride_s + (first + r)[None, :],
        mask=live[:, None] & r_ok[None, :],
        other=0.0,
    )
    mask = r_ok[:, None] & (rn < N)[None, :]
    for j in range(MAX_LORAS):
        mine = slots == j
        if tl.max(mine.to(tl.int32), axis=0) > 0:  # (a slot no row uses reads no B)
            sj = tl.where(mine[:, None], s, tl.zeros_like(s))
            ptrs = b_ptr + (j * W + first + r)[:, None] * stride_b + rn[None, :]
            acc = _add(acc, sj, tl.load(ptrs, mask=mask, other=0.0), DOT)
    return acc


@triton.jit
def lora_segment(
    acc, acc2, s_ptr, b_ptr, slots_ptr, rm, rn, M, N, OFF2, stride_s, stride_b, start1,
    start2, TWO: tl.constexpr, W: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
    MAX_LORAS: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """``acc`` (rows ``rm``, columns ``rn``) plus each row's ``s @ B_slot``, and with
    ``TWO`` ``acc2`` plus the same at columns ``rn + OFF2`` (see the module docstring)."""
    live = rm < M
    slots = tl.load(slots_ptr + rm, mask=live, other=-1)
    col = tl.min(rn, axis=0)
    acc = _expand(
        acc, s_ptr, b_ptr, slots, rm, rn, col, live, N, stride_s, stride_b, start1, start2,
        W, R, R_PAD, MAX_LORAS, DOT,
    )  # fmt: skip
    if TWO:
        acc2 = _expand(
            acc2, s_ptr, b_ptr, slots, rm, rn + OFF2, col + OFF2, live, N + OFF2, stride_s,
            stride_b, start1, start2, W, R, R_PAD, MAX_LORAS, DOT,
        )  # fmt: skip
    return acc, acc2


@triton.jit
def lora_prefetch(
    b_ptr, slots_ptr, rm, rn, M, OFF2, stride_b, start1, start2, TWO: tl.constexpr,
    W: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr, MAX_LORAS: tl.constexpr,
):  # fmt: skip
    """Pulls into L2 the B rows ``lora_segment`` will read for columns ``rn`` (and ``rn +
    OFF2``), for each slot a row uses: called before the PDL wait (no kernel of the step
    writes B or the row slots), so the segment after the K loop reads them from L2. A
    line a row: a program's columns of a row (at most 64 of 16 bits) are one."""
    slots = tl.load(slots_ptr + rm, mask=rm < M, other=-1)
    col = tl.min(rn, axis=0)
    r = tl.minimum(tl.arange(0, R_PAD), R - 1)
    for j in range(MAX_LORAS):
        if tl.max((slots == j).to(tl.int32), axis=0) > 0:
            rows = j * W + _member(col, start1, start2) * R + r
            _prefetch_l2(b_ptr + rows * stride_b + col)
            if TWO:
                rows = j * W + _member(col + OFF2, start1, start2) * R + r
                _prefetch_l2(b_ptr + rows * stride_b + col + OFF2)


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
