"""Paged KV cache: a pool of fixed-size blocks, and each request's block table."""

from __future__ import annotations

from collections import deque

import torch

from ostinato.mathutil import ceil_div


class BlockPool:
    """Hands out KV-cache block ids. Block 0 is reserved as the null block.

    Guarantees: a block id is owned by at most one request; ``free`` returns ids to the
    pool; ``allocate`` either returns exactly ``n`` ids or raises without taking any.
    The null block is never handed out: padded rows point at it, so their writes land
    where no request reads.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks: need at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks not owned by any request."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Exactly ``n`` free block ids, or ``MemoryError`` and none taken."""
        if n > len(self._free):
            raise MemoryError(f"KV cache: asked for {n} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        """Returns ``blocks`` to the pool."""
        self._free.extend(blocks)

    def reset(self) -> None:
        """Every block (but the null block) free again, whoever held it."""
        self._free = deque(range(1, self.num_blocks))


class KVCache:
    """Per-layer key and value tensors, ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Allocated once; their addresses never change, so captured graphs read them directly.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    return ceil_div(num_tokens, block_size)
