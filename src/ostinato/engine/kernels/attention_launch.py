"""How the paged-attention kernel (``triton_attention``) is compiled and launched: a
plain dataclass, importable without Triton, checked where its fields are set."""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_N = 64  # keys per iteration, spanning several pages
MAX_SPLITS = 16  # programs sharing one (token, KV head)'s keys, at most


def splits_for(num_tokens: int, kv_heads: int, sms: int) -> int:
    """Programs per (token, KV head): a power of two giving about two waves over ``sms``
    SMs, at most ``MAX_SPLITS``; never more for more tokens."""
    want = (2 * sms) // max(1, num_tokens * kv_heads)
    return 1 if want <= 1 else min(MAX_SPLITS, 1 << (want - 1).bit_length())


@dataclass(frozen=True)
class AttentionLaunch:
    """How the attention kernel is compiled and launched: keys per loop iteration
    (``block_n``, a power of two >= 16), warps per program, software-pipeline stages."""

    block_n: int = BLOCK_N
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        # Checked here, where the cause can be named: Triton would fail at compile time.
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(
                f"AttentionLaunch.block_n: a power of two >= 16 (tl.dot's smallest tile), "
                f"got {self.block_n}"
            )
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(
                f"AttentionLaunch.num_warps: a power of two >= 1, got {self.num_warps}"
            )
        if self.num_stages < 1:
            raise ValueError(f"AttentionLaunch.num_stages: >= 1, got {self.num_stages}")
