"""Each row's LoRA expand inside the small GEMM, before its epilogue: the *segment*.

A LoRA decode step of the QKV or gate/up group has each row's shrink ready before its
projection (the norm before it computed ``s = h @ A_slot.T``, ``kernels.rms_norm``'s
shrink). The projection's programs then add ``s[m] @ B_slot[:, their columns]`` to their
float32 sums before the epilogue (RoPE and the K/V write, or SiLU·mul) rounds them: the
expand needs no kernel of its own. A program loads its rows' slots before the PDL wait
(no kernel of the step writes them) and their shrinks right after it, both before its K
loop, so that neither round trip lengthens the kernel's tail. On tensor cores the B rows of
the two lowest slots its rows use are loaded before the wait too (no kernel of the step
writes B); the launches off them (the resident one, whose registers hold its weight tile,
and float32 rows) load them after their K loop. After
the loop, slot by slot, it multiplies that slot's rows of ``s`` (the other rows zeroed) by
its ``W`` rows of B at the program's columns: tensor cores where the GEMM's row tile is 16
(``DOT``), a product summed on CUDA cores for the resident launch's few rows. Slots past
the two early ones, up to the highest a row uses, are a loop without a branch, B's loads
masked off for a slot no row uses. With every row on one of two adapters (1.5 B shape,
H200), a LoRA step at 8 rows took 1.188 ms with a branch per slot, 1.125 with the loop over
every slot, 1.107-1.115 with the two slots' B loaded early (base step 0.977).
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
def _slot_b(b_ptr, rn, N, OFF2, stride_b, j, used, TWO: tl.constexpr, W: tl.constexpr,
            W_PAD: tl.constexpr):  # fmt: skip
    """Slot ``j``'s ``W`` rows of B at columns ``rn`` (and ``rn + OFF2`` with ``TWO``),
    ``[W_PAD, BLOCK_N]``; nothing read (zeros) unless ``used``."""
    w = tl.arange(0, W_PAD)
    mask = (w < W)[:, None] & (rn < N)[None, :] & used
    ptrs = b_ptr + (j * W + w)[:, None] * stride_b + rn[None, :]
    b = tl.load(ptrs, mask=mask, other=0.0)
    b2 = b
    if TWO:
        b2 = tl.load(ptrs + OFF2, mask=mask, other=0.0)
    return b, b2


@triton.jit
def lora_first_b(b_ptr, slots, rn, N, OFF2, stride_b, TWO: tl.constexpr, W: tl.constexpr,
                 W_PAD: tl.constexpr, MAX_LORAS: tl.constexpr):  # fmt: skip
    """The two lowest slots the rows use and their B rows at the program's columns
    (``_slot_b``; nothing read for a slot no row uses, whose number is then the one before
    it, or 0): loaded before the PDL wait, as no kernel of the step writes them, so that
    the first two slots' products after the K loop wait for no load."""
    lowest = tl.min(tl.where(slots >= 0, slots, MAX_LORAS), axis=0)
    used = lowest < MAX_LORAS
    j = tl.where(used, lowest, 0)
    b, b2 = _slot_b(b_ptr, rn, N, OFF2, stride_b, j, used, TWO, W, W_PAD)
    second = tl.min(tl.where(slots > j, slots, MAX_LORAS), axis=0)
    used_next = used & (second < MAX_LORAS)
    k = tl.where(used_next, second, j)
    c, c2 = _slot_b(b_ptr, rn, N, OFF2, stride_b, k, used_next, TWO, W, W_PAD)
    return j, b, b2, k, c, c2


@triton.jit
def _slot_add(
    acc, acc2, s, slots, j, b, b2, TWO: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """``acc`` (and with ``TWO`` ``acc2``) plus slot ``j``'s rows of ``s`` times its B rows
    ``b`` (``b2``)."""
    sj = tl.where((slots == j)[:, None], s, tl.zeros_like(s))
    acc = _add(acc, sj, b, DOT)
    if TWO:
        acc2 = _add(acc2, sj, b2, DOT)
    return acc, acc2


@triton.jit
def lora_segment(
    acc, acc2, s, slots, first, b_ptr, rn, N, OFF2, stride_b, TWO: tl.constexpr,
    W: tl.constexpr, W_PAD: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """``acc`` (columns ``rn``) plus each row's ``s @ B_slot`` (``s`` and ``slots`` as
    ``lora_shrunk`` and ``lora_slots`` loaded them, ``first`` as ``lora_first_b``), and
    with ``TWO`` ``acc2`` plus the same at columns ``rn + OFF2`` (see the module
    docstring)."""
    j0, b, b2, j1, c, c2 = first
    acc, acc2 = _slot_add(acc, acc2, s, slots, j0, b, b2, TWO, DOT)
    if j1 > j0:  # (a second slot in use)
        acc, acc2 = _slot_add(acc, acc2, s, slots, j1, c, c2, TWO, DOT)
    # The other slots up to the highest a row uses, each read only where a row uses it:
    # the products are a chain through ``acc``, and an unused slot's would be a link.
    for j in range(j1 + 1, tl.max(slots, axis=0) + 1):  # (unrolled: slower at one row)
        used = tl.max((slots == j).to(tl.int32), axis=0) > 0
        b, b2 = _slot_b(b_ptr, rn, N, OFF2, stride_b, j, used, TWO, W, W_PAD)
        acc, acc2 = _slot_add(acc, acc2, s, slots, j, b, b2, TWO, DOT)
    return acc, acc2
