"""The sizes an engine is built for, shared by its scheduler and its runner."""

from __future__ import annotations

from dataclasses import dataclass

from ostinato.mathutil import ceil_div


@dataclass(frozen=True)
class EngineLimits:
    """Sizes fixed at start-up; they size the persistent buffers and bound every step.

    Validated on construction: each is a positive int (``ValueError`` names the option).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")

    @property
    def blocks_per_seq(self) -> int:
        """KV blocks one sequence of ``max_model_len`` tokens needs."""
        return ceil_div(self.max_model_len, self.block_size)

    @property
    def full_blocks(self) -> int:
        """Blocks for every sequence at ``max_model_len`` at once, plus the null block."""
        return self.max_num_seqs * self.blocks_per_seq + 1
