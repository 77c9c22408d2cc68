"""How the paged-attention kernel (``triton_attention``) is compiled and launched: a
plain dataclass, importable without Triton, checked where its fields are set."""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_N = 64  # keys per iteration, spanning several pages
MAX_SPLITS = 16  # programs sharing one (token, KV head)'s keys, at most
# The H200 sweep (benchmarks/attention_sweep.py, 1.5 B shape, RESULTS.md): splitting keys
# for about four waves of programs instead of two took 3 to 27% off decode at 8 to 32
# tokens; 2 warps instead of 4 took 13 to 21% off unsplit launches (128 tokens, prefill)
# and cost 3 to 7% where keys are split; there 2 pipeline stages instead of 3 took 0 to 12%
# off (B=1 to 32), within 1% slower at 2048 keys and B=16 or 32.
WAVES = 4  # programs per SM the split count aims for
UNSPLIT_WARPS = 2
SPLIT_WARPS = 4
SPLIT_STAGES = 2
# With PDL and a step's new-key bound (``paged_attention``'s ``new_keys``), a program reads
# its first tile's older keys, the step's positions and block table before its PDL wait,
# while the QKV kernel before it still runs.
EARLY_KEYS = True


def splits_for(num_tokens: int, kv_heads: int, sms: int) -> int:
    """Programs per (token, KV head): a power of two giving about ``WAVES`` waves over
    ``sms`` SMs, at most ``MAX_SPLITS``; never more for more tokens."""
    want = (WAVES * sms) // max(1, num_tokens * kv_heads)
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


def launch_for(splits: int) -> AttentionLaunch:
    """The launch used where none is given: ``BLOCK_N`` keys per iteration; where a
    token's keys are split ``SPLIT_WARPS`` warps and ``SPLIT_STAGES`` stages, else
    ``UNSPLIT_WARPS`` warps and 3 stages. One compiled kernel per split layout still (the
    layout fixes the rest)."""
    if splits > 1:
        return AttentionLaunch(num_warps=SPLIT_WARPS, num_stages=SPLIT_STAGES)
    return AttentionLaunch(num_warps=UNSPLIT_WARPS)
