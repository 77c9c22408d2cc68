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
# With early keys a split reads its first tile before its PDL wait, so a wider tile moves
# more of its keys ahead of the wait, at the price of fewer, longer programs. In the H200
# step (``launch_rules --rules attention-tile`` and ``attention-tile-rule``, 513 keys,
# pipelined, two runs): where keys are split 8 ways or fewer (the 1.5 B shape's 8 and 16
# rows, where 64 left a split's second tile after the wait) 128 keys a tile took 1.4 to
# 2.3% off; with fewer than ``FEW_PAIRS`` (token, KV head) pairs (SmolLM2's 1 and 2 rows:
# 3 and 6) 256 keys in 8 warps took 4 to 7% off. The same 256 was 3% slower at 8 pairs
# (the 1.5 B shape's one row) and 18% at SmolLM2's 8 rows; 128 at 16 splits level or
# up to 6% slower.
EARLY_TILE = 128
EARLY_TILE_MAX_SPLITS = 8
FEW_PAIRS = 8
FEW_PAIRS_TILE = 256
FEW_PAIRS_WARPS = 8
# Bytes of keys and values a warp holds at most in a wider tile: what the measured ones
# hold at 64 dims in 16 bits (64 registers a thread), so wider heads, and float32 ones,
# keep ``BLOCK_N`` rather than spill. Float32 is why it counts bytes: on the H200
# (``results/fused_h200/float32_attention``) 256 float32 keys in 8 warps took 10.3 µs at
# SmolLM2's one row against 5.1 for 64 keys in 4, and they need 172 KB of shared memory
# (an offline sm_90 compile: ``attention_shared_memory_sm90.json`` there), more than an
# A100 (164 KB) or a consumer GPU (about 100 KB) gives a program.
TILE_BYTES_PER_WARP = 8192


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


def launch_for(
    splits: int, pairs: int = 0, early: bool = False, head_dim: int = 0, itemsize: int = 2
) -> AttentionLaunch:
    """The launch used where none is given for ``splits`` programs per (token, KV head)
    over ``pairs`` such pairs (0: unknown), ``early`` where keys are read before the PDL
    wait, heads of ``head_dim`` (0: unknown) of ``itemsize`` bytes an element. Unsplit:
    ``BLOCK_N`` keys per iteration, ``UNSPLIT_WARPS`` warps, 3 stages. Split:
    ``SPLIT_WARPS`` warps and ``SPLIT_STAGES`` stages, ``BLOCK_N`` keys a tile, or with
    ``early`` a wider first tile where its keys and values fit ``TILE_BYTES_PER_WARP``
    (``wide_tile_fits``): ``FEW_PAIRS_TILE`` keys in ``FEW_PAIRS_WARPS`` warps under
    ``FEW_PAIRS`` pairs, else ``EARLY_TILE`` at ``EARLY_TILE_MAX_SPLITS`` splits or fewer.
    Deterministic in its arguments, so a graph's launches repeat."""
    if splits == 1:
        return AttentionLaunch(num_warps=UNSPLIT_WARPS)
    few = FEW_PAIRS_TILE, FEW_PAIRS_WARPS
    if early and 0 < pairs < FEW_PAIRS and wide_tile_fits(*few, head_dim, itemsize):
        return AttentionLaunch(*few, SPLIT_STAGES)
    fewer_splits = splits <= EARLY_TILE_MAX_SPLITS
    if early and fewer_splits and wide_tile_fits(EARLY_TILE, SPLIT_WARPS, head_dim, itemsize):
        return AttentionLaunch(EARLY_TILE, SPLIT_WARPS, SPLIT_STAGES)
    return AttentionLaunch(num_warps=SPLIT_WARPS, num_stages=SPLIT_STAGES)


def wide_tile_fits(block_n: int, warps: int, head_dim: int, itemsize: int = 2) -> bool:
    """Whether a tile of ``block_n`` keys and values of ``head_dim`` elements of
    ``itemsize`` bytes is at most ``TILE_BYTES_PER_WARP`` bytes a warp (False for an
    unknown ``head_dim``, 0)."""
    return 0 < 2 * block_n * head_dim * itemsize <= TILE_BYTES_PER_WARP * warps
