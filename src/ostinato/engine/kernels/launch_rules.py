"""The launch rules: the measured choices of how the engine's kernels launch, as one
frozen value read where they launch.

``LaunchRules()`` is the rules the engine runs (each field's comment says what measured
it); ``rules()`` is the value in force, and ``rules_in_force(r)`` puts another in force
for a block, so a benchmark varies a rule with ``dataclasses.replace`` and nothing is
patched. The value is process-wide, not per thread, because a step's launches may run on
another thread than the one that built the model (background capture, the serve loop):
change it only while no engine steps. What a kernel is rather than how it is launched
(its tiles, its candidate configs, its scratch bounds) stays in the kernel's module.
Plain Python, importable without torch or Triton.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields

MiB = 1 << 20
LINE = 64  # 16-bit elements per 128-byte cache line: the prefetch's unit
ATTENTION_SPLITS = 16  # the most splits the attention kernel's merge takes (its constant)


@dataclass(frozen=True)
class LaunchRules:
    """How the kernels launch; every field is checked where it is set.

    Row counts are a step's rows (tokens); byte bounds are a projection's whole weight."""

    # -- programmatic dependent launch (``launch.pdl_for``, ``launch.pdl_arg``)
    # Steps of more rows run without PDL: on the H200 it slowed SmolLM2's decode steps of
    # 32 and 128 rows by 4 to 6%, while at 16 rows or fewer it is the gain.
    pdl_max_rows: int = 16
    # Whether a kernel lets the next launch before its PDL wait rather than after. Either
    # is safe (every kernel waits before its first dependent access); trigger-first was
    # level or slower in the step (``launch_rules --rules pdl-order``).
    trigger_first: bool = False

    # -- the small GEMM's plan without a measurement (``gemm_launch``, ``gemm_tuning``)
    # Up to this many weight bytes a projection runs the Triton GEMM: every projection of
    # the 1.5 B shape (8 to 64 MiB), whose layers are then six kernels; on the H200 its
    # step took 1.009 / 1.113 ms at B = 1 / 8 against 1.083 / 1.157 with cuBLAS above 8 MiB.
    small_weight_bytes: int = 64 * MiB
    # Whether the LM head within that bound is planned too (the final norm then runs in
    # its kernel): SmolLM2's step took 0.419 against 0.411 ms at one row, so it is not.
    plan_lm_head: bool = False
    # A split of at least this many K columns, a whole number of 256-column steps, steps
    # 256 at a time: the 1.5 B shape's split projections were faster so (QKV 10.8 against
    # 13.0 µs, down 12.2 against 14.1); SmolLM2's splits are shorter and keep 128.
    long_split_k: int = 512
    # Pipeline stages (3 or 4, the two ``CONFIGS`` holds) of an unsplit plain projection
    # of 32-column tiles: its few steps all in flight. SmolLM2's O took 2.71 against 2.98
    # µs at 3; gate/up and the split projections keep 3.
    unsplit_stages: int = 4
    # A *resident* launch (weight rows over the whole of K in registers, loaded before
    # the PDL wait) up to this many rows: two rows took SmolLM2's step from 0.650 to 0.540
    # ms and the 1.5 B shape's from 0.980 to 0.949; four were level or slower.
    resident_max_rows: int = 2
    # A weight of more bytes streams through the K loop instead: resident, it would fill
    # the register file, so the next kernel could not load its weight meanwhile.
    resident_max_bytes: int = 16 * MiB
    # Above this many weight elements a resident program has 8 warps, else 4.
    resident_wide: int = 8192
    # A *shared-memory* launch (``smem_gemm``: weight rows copied before the PDL wait,
    # tensor cores after) from ``resident_max_rows + 1`` up to this many rows: SmolLM2 at
    # 4 / 8 rows took 0.596 / 0.646 against 0.647 / 0.680 ms, but at 16 rows 0.794 against
    # 0.738. 0 turns it off.
    smem_max_rows: int = 8
    # Tiles a shared-memory program may hold: 1 (plain projections); with 2 (gate/up and
    # QKV too) SmolLM2 at 4 / 8 rows took 0.658 / 0.725 ms against 0.600 / 0.642.
    smem_max_tiles: int = 1
    # A weight of more bytes is not taken: past the SMs' shared memory (30 MB on the
    # H200) programs would wait for an SM, their copies no longer ahead of the wait. A
    # bound by reasoning, not measured.
    smem_max_bytes: int = 16 * MiB
    # Weight columns a K-loop program prefetches into L2 per row before its PDL wait (a
    # power-of-two number of cache lines); 128 measured slower in the step.
    prefetch_k: int = 512

    # -- paged attention (``attention_launch``)
    # Splitting a token's keys for about four waves of programs instead of two took 3 to
    # 27% off decode at 8 to 32 tokens (1.5 B shape); at most ``attention_max_splits``.
    attention_waves: int = 4
    attention_max_splits: int = 16
    # Warps of an unsplit launch: 2 instead of 4 took 13 to 21% off (128 tokens, prefill).
    unsplit_attention_warps: int = 2
    split_attention_warps: int = 4
    # Stages where keys are split: 2 instead of 3 took 0 to 12% off (B = 1 to 32).
    split_attention_stages: int = 2
    # With PDL and a step's new-key bound, a program reads its first tile's older keys,
    # the positions and the block table before its PDL wait, while QKV still runs.
    early_keys: bool = True
    # With early keys a split reads its first tile before its PDL wait, so a wider tile
    # moves more keys ahead of the wait, at the price of fewer, longer programs (513 keys,
    # pipelined, two runs): at ``early_tile_max_splits`` splits or fewer (the 1.5 B
    # shape's 8 and 16 rows) 128 keys a tile took 1.4 to 2.3% off; under ``few_pairs``
    # (token, KV head) pairs (SmolLM2's 1 and 2 rows) 256 keys in 8 warps took 4 to 7%
    # off, but were 3% slower at 8 pairs and 18% at SmolLM2's 8 rows.
    early_tile: int = 128
    early_tile_max_splits: int = 8
    few_pairs: int = 8
    few_pairs_tile: int = 256
    few_pairs_warps: int = 8

    # -- the model's kernels (``model.decoder``)
    # Fused layers on one GPU hand each norm its row statistics: a SmolLM2 layer's four
    # GEMM kernels took 16.9 against 19.4 µs at one row, the 1.5 B shape's 55.6 against 57.1.
    row_stats: bool = True
    # An eager step on one rank takes its embedding rows and RoPE rows in one kernel:
    # SmolLM2's step took 0.402 against 0.407 ms at one row, 0.681 against 0.689 at 8.
    embed_rope: bool = True
    # An unfused layer's QKV projection, eagerly (under tensor parallelism every decode
    # size runs so), writes the rotated keys and the values in its own kernel, as the
    # fused layers' does, where its plan runs the Triton GEMM: one K/V-write kernel less a
    # layer.
    rope_kv_unfused: bool = True
    # An unfused layer's QKV kernel with the K/V write launches on the projection's
    # measured plan entry rather than a program per head in ``rope_config``'s splits: the
    # 8 B shape's TP=2 step took 2.796 against 2.898 ms at one row. The fused layers'
    # (with the norm in front) keep ``rope_config``'s: on the plan entry the 1.5 B shape's
    # step took 1.041-1.098 against 0.989-1.051 ms at 8 rows, level at one.
    qkv_on_plan: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"LaunchRules.{f.name}: an int >= 0, got {value!r}")
        if self.unsplit_stages not in (3, 4):
            raise ValueError(
                f"LaunchRules.unsplit_stages: 3 or 4 (the unsplit shapes the GEMM's configs "
                f"hold), got {self.unsplit_stages}"
            )
        if self.smem_max_tiles not in (1, 2):
            raise ValueError(f"LaunchRules.smem_max_tiles: 1 or 2, got {self.smem_max_tiles}")
        _power_of_two("attention_max_splits", self.attention_max_splits, ATTENTION_SPLITS)
        for name in ("unsplit_attention_warps", "split_attention_warps", "few_pairs_warps"):
            _power_of_two(name, getattr(self, name), 32)
        for name in ("early_tile", "few_pairs_tile"):  # tl.dot's smallest tile is 16
            _power_of_two(name, getattr(self, name), 1 << 12)
            if getattr(self, name) < 16:
                raise ValueError(f"LaunchRules.{name}: at least 16, got {getattr(self, name)}")
        lines = self.prefetch_k // LINE
        if self.prefetch_k % LINE or lines < 1 or lines & (lines - 1):
            raise ValueError(
                f"LaunchRules.prefetch_k: a power of two of {LINE}-column cache lines, "
                f"got {self.prefetch_k}"
            )
        if self.attention_waves < 1 or self.split_attention_stages < 1:
            raise ValueError("LaunchRules: attention_waves and split_attention_stages >= 1")


def _power_of_two(name: str, value: int, most: int) -> None:
    if value < 1 or value & (value - 1) or value > most:
        raise ValueError(f"LaunchRules.{name}: a power of two up to {most}, got {value}")


_in_force = LaunchRules()


def rules() -> LaunchRules:
    """The launch rules in force (``LaunchRules()`` unless ``rules_in_force`` says else)."""
    return _in_force


@contextlib.contextmanager
def rules_in_force(value: LaunchRules) -> Iterator[LaunchRules]:
    """Puts ``value`` in force for the block (restored after, also on an exception):
    everything built, planned, captured or launched inside it follows ``value``. A graph
    captured inside keeps the launches it captured after the block."""
    if not isinstance(value, LaunchRules):
        raise TypeError(f"rules_in_force: a LaunchRules, got {type(value).__name__}")
    global _in_force
    before, _in_force = _in_force, value
    try:
        yield value
    finally:
        _in_force = before
