"""How the paged-attention kernel (``triton_attention``) is compiled and launched: a
plain dataclass, importable without Triton, checked where its fields are set."""

from __future__ import annotations

from dataclasses import dataclass

from ostinato.engine.kernels.launch_rules import ATTENTION_SPLITS, rules

BLOCK_N = 64  # keys per iteration, spanning several pages
MAX_SPLITS = ATTENTION_SPLITS  # programs sharing one (token, KV head)'s keys, at most
# Bytes of keys and values a warp holds at most in a wider tile: what the measured ones
# hold at 64 dims in 16 bits (64 registers a thread), so wider heads, and float32 ones,
# keep ``BLOCK_N`` rather than spill. Float32 is why it counts bytes: on the H200
# (``results/fused_h200/float32_attention``) 256 float32 keys in 8 warps took 10.3 µs at
# SmolLM2's one row against 5.1 for 64 keys in 4, and they need 172 KB of shared memory
# (an offline sm_90 compile: ``attention_shared_memory_sm90.json`` there), more than an
# A100 (164 KB) or a consumer GPU (about 100 KB) gives a program.
TILE_BYTES_PER_WARP = 8192


def splits_for(num_tokens: int, kv_heads: int, sms: int) -> int:
    """Programs per (token, KV head): a power of two giving about
    ``LaunchRules.attention_waves`` waves over ``sms`` SMs, at most
    ``LaunchRules.attention_max_splits``; never more for more tokens."""
    r = rules()
    want = (r.attention_waves * sms) // max(1, num_tokens * kv_heads)
    return 1 if want <= 1 else min(r.attention_max_splits, 1 << (want - 1).bit_length())


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
    ``BLOCK_N`` keys per iteration, ``LaunchRules.unsplit_attention_warps`` warps, 3
    stages. Split: ``split_attention_warps`` warps and ``split_attention_stages`` stages
    (the rules'), ``BLOCK_N`` keys a tile, or with
    ``early`` a wider first tile where its keys and values fit ``TILE_BYTES_PER_WARP``
    (``wide_tile_fits``): ``few_pairs_tile`` keys in ``few_pairs_warps`` warps under
    ``few_pairs`` pairs, else ``early_tile`` at ``early_tile_max_splits`` splits or fewer.
    Deterministic in its arguments, so a graph's launches repeat."""
    r = rules()
    if splits == 1:
        return AttentionLaunch(num_warps=r.unsplit_attention_warps)
    stages, warps = r.split_attention_stages, r.split_attention_warps
    few = r.few_pairs_tile, r.few_pairs_warps
    if early and 0 < pairs < r.few_pairs and wide_tile_fits(*few, head_dim, itemsize):
        return AttentionLaunch(*few, stages)
    fewer_splits = splits <= r.early_tile_max_splits
    if early and fewer_splits and wide_tile_fits(r.early_tile, warps, head_dim, itemsize):
        return AttentionLaunch(r.early_tile, warps, stages)
    return AttentionLaunch(num_warps=warps, num_stages=stages)


def wide_tile_fits(block_n: int, warps: int, head_dim: int, itemsize: int = 2) -> bool:
    """Whether a tile of ``block_n`` keys and values of ``head_dim`` elements of
    ``itemsize`` bytes is at most ``TILE_BYTES_PER_WARP`` bytes a warp (False for an
    unknown ``head_dim``, 0)."""
    return 0 < 2 * block_n * head_dim * itemsize <= TILE_BYTES_PER_WARP * warps
