"""Paged KV cache: a pool of fixed-size blocks, and each request's block table."""

from __future__ import annotations

from collections import deque

import torch

from ostinato.mathutil import ceil_div


class BlockPool:
    """Hands out KV-cache block ids. Block 0 is reserved as the null block.

    Guarantees: a block is free only once every request holding it has let it go: one
    request owns a block from ``allocate``, and ``share`` adds holders to blocks already
    held (the full prompt blocks that the samples of one prompt read and never write);
    ``free`` drops one holder of each block; ``allocate`` either returns exactly ``n``
    ids or raises without taking any. The null block is never handed out: padded rows
    point at it, so their writes land where no request reads.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks: need at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._holders = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    def holders(self, block: int) -> int:
        """How many requests hold ``block`` (0: free)."""
        return self._holders[block]

    def allocate(self, n: int) -> list[int]:
        """Exactly ``n`` free block ids, or ``MemoryError`` and none taken."""
        if n > len(self._free):
            raise MemoryError(f"KV cache: asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._holders[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> list[int]:
        """One more holder for each of ``blocks`` (held already); returns them."""
        for b in blocks:
            if self._holders[b] == 0:
                raise ValueError(f"KV cache: block {b} is free; only held blocks are shared")
            self._holders[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Lets go of ``blocks`` once each; a block nobody holds returns to the pool."""
        for b in blocks:
            if self._holders[b] == 0:
                raise ValueError(f"KV cache: block {b} freed more often than it was held")
            self._holders[b] -= 1
            if self._holders[b] == 0:
                self._free.append(b)

    def reset(self) -> None:
        """Every block (but the null block) free again, whoever held it."""
        self._free = deque(range(1, self.num_blocks))
        self._holders = [0] * self.num_blocks


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
