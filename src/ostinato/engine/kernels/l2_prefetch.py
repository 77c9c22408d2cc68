"""Asking the L2 cache to fetch a weight ahead of the kernel that reads it.

A decode step at a few rows leaves the memory idle while its short kernels (attention,
its split merge) wait on one another; the weight read after them streams from memory
afterwards. ``l2_prefetch``, called by the programs of such a kernel, has each program
issue bulk L2 prefetches (``cp.async.bulk.prefetch.L2``, compute capability 9.0) for its
share of a tensor's first bytes and go on at once: the bytes arrive while the kernel
runs, and the next kernels find them in L2. It is a hint: nothing is written, nothing
waits for it, and a prefetch the memory system drops costs only its time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Bytes one prefetch instruction asks for (a multiple of 16, as the instruction needs).
CHUNK_BYTES = 4096
_CHUNK = tl.constexpr(CHUNK_BYTES)
_ASM = tl.constexpr(f"cp.async.bulk.prefetch.L2.global [$1], {CHUNK_BYTES};\n\tmov.u32 $0, 0;")
_BLOCK = tl.constexpr(128)  # chunks a program asks for per loop step: one a thread of 4 warps


@triton.jit
def l2_prefetch(base, chunks, part, parts):
    """Prefetches into L2 the chunks ``part, part + parts, ...`` (``CHUNK_BYTES`` each)
    of the ``chunks`` whole chunks at ``base``: a grid of ``parts`` programs, each
    calling this with its own ``part``, covers them all."""
    at = base.to(tl.pointer_type(tl.int8))
    for first in range(part * _BLOCK, chunks, parts * _BLOCK):
        # Past the end, a thread asks for the last chunk again: harmless, and no mask.
        chunk = tl.minimum(first + tl.arange(0, _BLOCK), chunks - 1)
        tl.inline_asm_elementwise(
            _ASM,
            "=r,l",
            [at + chunk.to(tl.int64) * _CHUNK],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def warm_chunks(t: torch.Tensor | None, max_bytes: int) -> int:
    """Whole ``CHUNK_BYTES`` chunks within the first ``max_bytes`` of ``t``'s elements
    (0 for None, an empty or non-contiguous tensor, or a start the instruction cannot
    take: not 16-byte aligned): what ``l2_prefetch`` may ask for without reading past
    the tensor."""
    if t is None or not t.is_contiguous() or t.data_ptr() % 16:
        return 0
    return min(t.numel() * t.element_size(), max(0, max_bytes)) // CHUNK_BYTES
