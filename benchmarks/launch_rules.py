"""A decode step under other launch rules for ostinato's kernels, one run: which
projections run the Triton GEMM without a measurement (``gemm_tuning.SMALL_WEIGHT_BYTES``:
up to 8 MiB, or up to the 1.5 B shape's 64 MiB gate/up, which makes every layer six
kernels), whether long splits step 256 K columns (``gemm_launch.LONG_SPLIT_K``), how many
weight columns a program prefetches before its PDL wait (``small_gemm.PREFETCH_K``),
gate/up's tile width, attention's split count, warps and stages
(``attention_launch.WAVES``, ``UNSPLIT_WARPS``, ``SPLIT_STAGES``), and the largest step
launched with PDL (``launch.PDL_MAX_ROWS``), and whether fused layers hand their norms row
statistics (``decoder.ROW_STATS``), an unsplit projection's pipeline stages
(``gemm_launch.UNSPLIT_STAGES``), and whether a kernel lets the next launch before its PDL
wait (``launch.TRIGGER_FIRST``), and which projections of one row run resident
(``gemm_launch.RESIDENT_MAX_ROWS``, ``RESIDENT_MAX_BYTES``), and whether attention reads
older keys before its PDL wait (``attention_launch.EARLY_KEYS``), the projections'
splits, and whether attention's kernels let the next launch before their PDL wait, and
attention's most splits and its key tile where keys are split, and above how many
weight elements a resident program has 8 warps (``gemm_launch.RESIDENT_WIDE``), and
whether the LM head is planned (``gemm_tuning.PLAN_LM_HEAD``), and whether a step's
embedding and RoPE rows come from one kernel (``decoder.EMBED_ROPE``), and whether a
decode graph writes its logits and tokens where replays read them, and whether
projections of 3 to 8 rows hold their weight in shared memory (plain ones only, or QKV
and gate/up too). Each
rule is set here between runs and restored; the first rule of a set runs again last, so
drift shows as A against A.

``python -m benchmarks.launch_rules --out results.json [--batch-sizes 1,8,16]
[--rules steps|sizes|attention|attention-stages|pdl-rows|row-stats|row-stats-six|
unsplit-stages|pdl-order|resident|resident-rows|resident-down|early-keys|
down-splits|down-width|down-steps|qkv-o-splits|attention-trigger|attention-splits|
prefetch|resident-warps|attention-tile|attention-tile-rule|attention-tile-few|rope-table|
lm-head|lm-head-tiles|embed-rope|static-outputs|smem|smem-two]
[--shape llama-1.5b|smollm2] [--profile]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from unittest import mock

import torch

from benchmarks import decode
from benchmarks.decode import SMOLLM2_CONFIG, model_config
from ostinato.engine.kernels import (
    attention_launch,
    gemm_launch,
    launch,
    paged_attention,
    small_gemm,
)
from ostinato.engine.model import decoder
from ostinato.engine.model.rope import rope_cos_sin
from ostinato.engine.worker import gemm_tuning, runner
from ostinato.provenance import Provenance

VARIANT = "ostinato FULL_AND_PIECEWISE"
MiB = 1 << 20
OFF = 1 << 30  # a LONG_SPLIT_K or PDL_MAX_ROWS no step reaches: the rule never applies


@dataclass(frozen=True)
class Rule:
    """One setting of the launch rules; a field left out keeps the library's default."""

    name: str
    weight_bytes: int = gemm_tuning.SMALL_WEIGHT_BYTES
    long_split_k: int = gemm_launch.LONG_SPLIT_K
    prefetch_k: int = small_gemm.PREFETCH_K
    narrow_gate_up: bool = False  # 32-column gate/up tiles where the rule says 64
    attention_waves: int = attention_launch.WAVES
    unsplit_attention_warps: int = attention_launch.UNSPLIT_WARPS
    split_attention_stages: int = attention_launch.SPLIT_STAGES
    pdl_max_rows: int = launch.PDL_MAX_ROWS
    row_stats: bool = decoder.ROW_STATS
    unsplit_stages: int = gemm_launch.UNSPLIT_STAGES
    trigger_first: bool = launch.TRIGGER_FIRST
    resident_max_rows: int = gemm_launch.RESIDENT_MAX_ROWS
    resident_max_bytes: int = gemm_launch.RESIDENT_MAX_BYTES
    resident_wide: int = gemm_launch.RESIDENT_WIDE
    early_keys: bool = attention_launch.EARLY_KEYS
    # (splits the rule names, splits instead, tile width) for plain projections (at the
    # 1.5 B shape: 8 the down projection, 4 the output projection), or None
    resplit: tuple[int, int, int] | None = None
    qkv_splits: int = 0  # the QKV projection's K splits where not resident; 0: the rule's
    # (K step, pipeline stages) of the plain projections the rule gives 8 splits, or None
    eight_split_steps: tuple[int, int] | None = None
    # which of attention's two kernels let the next launch before their PDL wait: none
    # (the default), "merge" (the split merge, so the output projection launches while
    # attention runs), or "both"
    attention_trigger_first: str = ""
    attention_max_splits: int = attention_launch.MAX_SPLITS
    # (keys per tile, warps) of attention where a token's keys are split, or None: the
    # library's. With early keys a program reads its first tile before its PDL wait, so
    # a wider tile moves more of its keys ahead of the wait.
    split_attention_tile: tuple[int, int] | None = None
    # whether the model looks its steps' cos and sin up in its RoPE table (the
    # default, ``DecoderModel(max_positions=...)``) or computes them each step
    rope_table: bool = True
    # whether an eager step takes its embedding and RoPE rows in one kernel
    # (``decoder.EMBED_ROPE``) or two lookups; without the table, always two
    embed_rope: bool = decoder.EMBED_ROPE
    # whether the LM head is planned too, so the final norm runs inside its kernel
    # (``gemm_tuning.PLAN_LM_HEAD``), or stays on cuBLAS after a norm kernel
    plan_lm_head: bool = gemm_tuning.PLAN_LM_HEAD
    # (columns, warps, K step) of the LM head's unsplit tile where the rule names 64
    # columns in 8 warps, or None
    lm_head_tile: tuple[int, int, int] | None = None
    # whether a decode graph's LM head and argmax write where its replays are read
    # (``ForwardContext.outputs``) or the graph copies their results there
    outputs_in_place: bool = True
    # whether projections of 3 to 8 rows (the rule's) hold their weight in shared memory
    # where it fits (``gemm_launch.smem_config``) or run the K loop; and the most tiles
    # such a program holds: 1 (plain only) or 2 (QKV with RoPE, gate/up with SwiGLU too)
    smem: bool = True
    smem_tiles: int = gemm_launch.SMEM_MAX_TILES


# The sets "steps" and "sizes" were measured before the attention rule changed: they
# keep the attention launch of then.
_OLD = dict(attention_waves=2, unsplit_attention_warps=4, split_attention_stages=3)
_FUSED = dict(weight_bytes=64 * MiB, **_OLD)
RULES = {
    # Plain projections (O, down) of 3 rows and more with their weight in shared memory
    # across the PDL wait (``smem_gemm``; up to 16 rows in the first run, 8 since), or
    # the K loop as before.
    "smem": (
        Rule("shared-memory launch from 3 rows"),
        Rule("K loop from 3 rows", smem=False),
    ),
    # Only the plain projections (O, down) of 3 to 8 rows in shared memory, or QKV (RoPE,
    # the K/V write) and gate/up (SwiGLU) too. Measured first in the other order (two
    # tiles as A): two tiles were slower at both shapes (``gemm_launch.SMEM_MAX_TILES``).
    "smem-two": (
        Rule("plain projections only"),
        Rule("QKV and gate/up in shared memory too", smem_tiles=2),
    ),
    # A step's embedding rows and RoPE table rows: one kernel launched with PDL, or
    # torch's two lookups (an index-select and an index kernel) as before.
    "embed-rope": (
        Rule("embeddings and RoPE rows in one kernel"),
        Rule("two lookups", embed_rope=False),
    ),
    # The final norm inside the LM head's kernel (the LM head planned where its weight is
    # at most 64 MiB: SmolLM2's), or a norm kernel then cuBLAS as before; and the 1.5 B
    # shape's LM head (501 MiB) planned too.
    "lm-head": (
        Rule("final norm in the LM head", plan_lm_head=True),
        Rule("norm kernel, cuBLAS LM head", plan_lm_head=False),
        Rule("final norm in any LM head", weight_bytes=OFF, plan_lm_head=True),
    ),
    # The planned LM head (SmolLM2's 49152 columns over K = 576) in other tiles, against
    # cuBLAS after a norm kernel.
    "lm-head-tiles": (
        Rule("norm kernel, cuBLAS LM head", plan_lm_head=False),
        Rule("LM head 64 wide, 8 warps, K 128", plan_lm_head=True),
        Rule("LM head 64 wide, 8 warps, K 64", plan_lm_head=True, lm_head_tile=(64, 8, 64)),
        Rule("LM head 128 wide, 8 warps, K 64", plan_lm_head=True, lm_head_tile=(128, 8, 64)),
        Rule("LM head 32 wide, 4 warps, K 64", plan_lm_head=True, lm_head_tile=(32, 4, 64)),
    ),
    # A step's cos and sin: one lookup in the model's table, or seven kernels computing
    # them (a cast, a product, a concatenation, cos, sin, two roundings) as before the table.
    "rope-table": (
        Rule("cos and sin from the table"),
        Rule("cos and sin computed each step", rope_table=False),
    ),
    "steps": (
        Rule("8 MiB, K step 128", 8 * MiB, long_split_k=OFF, **_OLD),
        Rule("8 MiB, long splits step 256", 8 * MiB, long_split_k=512, **_OLD),
        Rule("64 MiB, K step 128", long_split_k=OFF, **_FUSED),
        Rule("64 MiB, long splits step 256", long_split_k=512, **_FUSED),
        Rule("64 MiB, 256, prefetch 2048", long_split_k=512, prefetch_k=2048, **_FUSED),
        Rule("64 MiB, 256, gate/up 32 wide", long_split_k=512, narrow_gate_up=True, **_FUSED),
    ),
    # One projection more at a time: QKV (12 MiB), down (32 MiB), gate/up (64 MiB).
    "sizes": (
        Rule("8 MiB, K step 128", 8 * MiB, long_split_k=OFF, **_OLD),
        Rule("12 MiB, 256", 12 * MiB, long_split_k=512, **_OLD),
        Rule("32 MiB, 256", 32 * MiB, long_split_k=512, **_OLD),
        Rule("64 MiB, 256, gate/up 32 wide", long_split_k=512, narrow_gate_up=True, **_FUSED),
    ),
    # Attention's split count for about two waves or four, 4 or 2 warps unsplit (split
    # launches then had 3 stages).
    "attention": (
        Rule("attention 2 waves, 4 warps", **_OLD),
        Rule("attention 4 waves, 2 warps unsplit", split_attention_stages=3),
    ),
    "attention-stages": (
        Rule("split attention 3 stages", split_attention_stages=3),
        Rule("split attention 2 stages", split_attention_stages=2),
    ),
    # Row statistics handed to the norms against norms that pass over their rows; with
    # them, six kernels a layer at the 1.5 B shape (64 MiB) again.
    "row-stats": (
        Rule("norms pass over their rows", row_stats=False),
        Rule("row statistics", row_stats=True),
    ),
    "row-stats-six": (
        Rule("8 MiB, norms pass over their rows", row_stats=False),
        Rule("8 MiB, row statistics", row_stats=True),
        Rule("64 MiB, row statistics", 64 * MiB, row_stats=True),
        Rule("64 MiB, gate/up 32 wide, row stats", 64 * MiB, narrow_gate_up=True),
    ),
    # An unsplit plain projection's pipeline in 3 stages, as before, or all its steps in
    # flight (SmolLM2's O; the 1.5 B shape has none at 16 rows or fewer).
    "unsplit-stages": (
        Rule("unsplit plain: 3 stages", unsplit_stages=3),
        Rule("unsplit plain: 4 stages", unsplit_stages=4),
    ),
    # A kernel lets the next one launch after its PDL wait, as before, or before it (so
    # launches run ahead and weight prefetches start earlier), and with that a longer
    # prefetch.
    "pdl-order": (
        Rule("wait, then launch dependents", trigger_first=False),
        Rule("launch dependents, then wait", trigger_first=True),
        Rule("launch first, prefetch 2048", trigger_first=True, prefetch_k=2048),
    ),
    # One-row projections with their weight held in registers (none, those of at most
    # 16 MiB, all that fit a program).
    "resident": (
        Rule("no resident launch", resident_max_rows=0),
        Rule("resident up to 16 MiB"),
        Rule("resident, any weight", resident_max_bytes=OFF),
    ),
    # Projections of up to 16 MiB resident at one row (as before), or up to 2 or 4 rows
    # (the products of every row summed at once on CUDA cores).
    "resident-rows": (
        Rule("resident at 1 row"),
        Rule("resident up to 2 rows", resident_max_rows=2),
        Rule("resident up to 4 rows", resident_max_rows=4),
    ),
    # The 1.5 B down projection (32 MiB) resident too, its gate/up (64 MiB) not.
    "resident-down": (
        Rule("resident up to 16 MiB"),
        Rule("resident up to 32 MiB", resident_max_bytes=32 * MiB),
    ),
    # Attention reads its first tile's older keys before its PDL wait, or waits first.
    "early-keys": (
        Rule("attention waits first", early_keys=False),
        Rule("older keys before the wait"),
    ),
    # The 1.5 B down projection (8192 columns of K) in 8 splits of 64-column tiles, or in 4
    # of 64 or 32 columns: fewer partials to reduce, as many or more programs.
    "down-splits": (
        Rule("down: 8 splits, 64 wide"),
        Rule("down: 4 splits, 64 wide", resplit=(8, 4, 64)),
        Rule("down: 4 splits, 32 wide", resplit=(8, 4, 32)),
    ),
    # The same 8 splits in 32-column tiles: 512 programs of half the weight each, three
    # to an SM by shared memory, against 256 of which one fits an SM.
    "down-width": (
        Rule("down: 8 splits, 64 wide"),
        Rule("down: 8 splits, 32 wide", resplit=(8, 8, 32)),
    ),
    # The 1.5 B down projection's 256 programs (8 splits of 64 columns) hold 120 KiB of
    # shared memory each at 256-column K steps in 3 stages, one to an SM: two waves. At
    # 128-column steps (60 KiB) or in 2 stages (80 KiB) they fit in one.
    "down-steps": (
        Rule("down: K step 256, 3 stages"),
        Rule("down: K step 128, 3 stages", eight_split_steps=(128, 3)),
        Rule("down: K step 256, 2 stages", eight_split_steps=(256, 2)),
    ),
    # The 1.5 B shape's QKV and output projections (at more than two rows: their K loops)
    # in 4 splits, or in 8: half as many K steps a program, twice the partials.
    "qkv-o-splits": (
        Rule("QKV and O: 4 splits"),
        Rule("QKV and O: 8 splits", resplit=(4, 8, 32), qkv_splits=8),
    ),
    # Attention's kernels wait, then let the next launch (the default), or the split
    # merge lets the output projection launch first, so its resident weight loads while
    # attention runs; or attention lets the merge launch first too.
    "attention-trigger": (
        Rule("attention and merge wait first"),
        Rule("merge triggers first", attention_trigger_first="merge"),
        Rule("both trigger first", attention_trigger_first="both"),
    ),
    # At most 16 splits of a token's keys (at 512 keys and one or two rows, 8 of them
    # with a 64-key tile each, the rest empty), or at most 8 or 4: fewer partials to merge.
    "attention-splits": (
        Rule("attention: at most 16 splits"),
        Rule("attention: at most 8 splits", attention_max_splits=8),
        Rule("attention: at most 4 splits", attention_max_splits=4),
    ),
    # Attention's key tile where keys are split: 64 keys in 4 warps (the default when it
    # ran), 128 in 4 or 8, 256 in 8. At the benchmark's 513 keys a split then holds one
    # tile, read before the PDL wait, where at 64 keys a split of 128 walks its second
    # after it.
    "attention-tile": (
        Rule("attention tile 64, 4 warps", split_attention_tile=(64, 4)),
        Rule("attention tile 128, 4 warps", split_attention_tile=(128, 4)),
        Rule("attention tile 128, 8 warps", split_attention_tile=(128, 8)),
        Rule("attention tile 256, 8 warps", split_attention_tile=(256, 8)),
    ),
    # Where the rule takes 256 keys in 8 warps (SmolLM2's one and two rows), other wide
    # tiles: 256 in 4 warps, 256 with at most 4 splits (fewer empty programs: at 513 keys
    # 3 of 16 splits hold keys), 512 in 16 warps (2 splits hold keys).
    "attention-tile-few": (
        Rule("attention tile by rule"),
        Rule("attention tile 256, 4 warps", split_attention_tile=(256, 4)),
        Rule("tile 256, 8 warps, 4 splits", split_attention_tile=(256, 8), attention_max_splits=4),
        Rule("attention tile 512, 16 warps", split_attention_tile=(512, 16)),
    ),
    # The tile by ``attention_launch.launch_for``'s rule against 64 keys everywhere.
    "attention-tile-rule": (
        Rule("attention tile by rule"),
        Rule("attention tile 64, 4 warps", split_attention_tile=(64, 4)),
    ),
    # A K-loop program's weight prefetch before its PDL wait: 512 columns a row (the
    # default) or 128. (Two more rules, the prefetch marked last to be evicted from L2,
    # ran with ``results/fused_h200/probes_prefetch_merge/prefetch_keep.patch.txt``.)
    "prefetch": (
        Rule("prefetch 512 columns"),
        Rule("prefetch 128 columns", prefetch_k=128),
    ),
    # A resident program holding more than 8192 weight elements in 8 warps (the
    # default: the 1.5 B QKV at 64 registers a thread, 16 K a program), or in 4 (103
    # registers, 13 K a program: three fit an SM beside two of the down projection's
    # programs, against two, so more of the 384 QKV programs may load during the down
    # projection: a reading of the registers, not timed per program).
    "resident-warps": (
        Rule("resident: 8 warps above 8192"),
        Rule("resident: 4 warps", resident_wide=OFF),
    ),
    # A decode graph's logits and greedy tokens written where replays read them, or
    # copied there at the graph's end (two copy kernels; at 128 rows of a 128k
    # vocabulary 33 MB).
    "static-outputs": (
        Rule("logits and tokens written in place"),
        Rule("logits and tokens copied", outputs_in_place=False),
    ),
    # PDL for steps of more than 16 rows too (run with --batch-sizes 32,128).
    "pdl-rows": (
        Rule("PDL up to 16 rows", pdl_max_rows=16),
        Rule("PDL at every row count", pdl_max_rows=OFF),
    ),
}


@dataclass(frozen=True)
class Timing:
    rule: str
    batch: int
    step_ms: float
    pipelined_ms: float | None
    kernels_in_layer: int | None
    # [kernel name, launches per step, µs per step] from the step's device profile
    kernels: list[tuple[str, float, float]]


# A change to the config the rule names for a projection (its K, whether gate/up), or
# None to keep it
Change = Callable[[gemm_launch.GemmConfig, int, bool], gemm_launch.GemmConfig | None]


def _narrow_gate_up(
    c: gemm_launch.GemmConfig, k: int, swiglu: bool
) -> gemm_launch.GemmConfig | None:
    """32-column gate/up tiles where the rule names 64-column unsplit ones."""
    if swiglu and (c.block_n, c.split_k) == (64, 1):
        return gemm_launch.GemmConfig(32, 1, block_k=c.block_k)
    return None


def _resplit(named: int, split: int, block_n: int) -> Change:
    """``split`` splits of ``block_n``-column tiles where the rule names ``named`` splits
    of a plain projection."""

    def change(c: gemm_launch.GemmConfig, k: int, swiglu: bool) -> gemm_launch.GemmConfig | None:
        if swiglu or c.split_k != named:
            return None
        return gemm_launch.GemmConfig(block_n, split, block_k=gemm_launch.k_step(k, split))

    return change


def _eight_split_steps(block_k: int, stages: int) -> Change:
    """``block_k``-column steps in ``stages`` stages where the rule names 8 splits of a
    plain projection."""

    def change(c: gemm_launch.GemmConfig, k: int, swiglu: bool) -> gemm_launch.GemmConfig | None:
        if swiglu or c.split_k != 8:
            return None
        return replace(c, block_k=block_k, num_stages=stages)

    return change


def _lm_head_tile(tile: gemm_launch.GemmConfig) -> Change:
    """``tile`` where the rule names an unsplit 64-column tile in 8 warps for a plain
    projection (the LM head)."""

    def change(c: gemm_launch.GemmConfig, k: int, swiglu: bool) -> gemm_launch.GemmConfig | None:
        wide = (c.block_n, c.split_k, c.num_warps) == (64, 1, 8)
        return tile if wide and not swiglu and not c.resident else None

    return change


def _with_configs(settings: list, extra: tuple[gemm_launch.GemmConfig, ...]) -> None:
    """``settings`` extended to make ``extra`` launch shapes the GEMM's configs too."""
    configs = gemm_launch.CONFIGS + tuple(c for c in extra if c not in gemm_launch.CONFIGS)
    settings.append((gemm_launch, "CONFIGS", configs))
    settings.append((small_gemm, "CONFIGS", configs))


def _repick(pick: Callable[..., int], changes: list[Change]) -> Callable[..., int]:
    """``pick`` (``gemm_launch.pick_config``) with each of ``changes`` applied in turn to
    the config it names (a change returning None leaves it), as an index into
    ``gemm_launch.CONFIGS`` as it is when called."""

    def repicked(n: int, k: int, sms: int, swiglu: bool = False) -> int:
        c = gemm_launch.CONFIGS[pick(n, k, sms, swiglu) - 1]
        for change in changes:
            c = change(c, k, swiglu) or c
        return gemm_launch.CONFIGS.index(c) + 1

    return repicked


def _split_tile(block_n: int, warps: int) -> Callable[..., attention_launch.AttentionLaunch]:
    """``attention_launch.launch_for`` with ``block_n`` keys a tile in ``warps`` warps where
    keys are split."""

    def launch_for(splits: int, *_: object) -> attention_launch.AttentionLaunch:
        if splits == 1:
            return attention_launch.launch_for(splits)
        stages = attention_launch.SPLIT_STAGES
        return attention_launch.AttentionLaunch(block_n, num_warps=warps, num_stages=stages)

    return launch_for


def _computed_rope(
    model: decoder.DecoderModel, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DecoderModel.rope`` without its table: computed each step."""
    return rope_cos_sin(positions, model.inv_freq, dtype)


def _trigger_first(pdl: bool) -> int:
    return launch.TRIGGER_THEN_WAIT if pdl else 0


def _merge_first(merge: Callable[..., None]) -> Callable[..., None]:
    """``paged_attention._merge_splits`` launching its kernel trigger-first."""

    def first(*args: object) -> None:
        with mock.patch.object(paged_attention, "pdl_arg", _trigger_first):
            merge(*args)

    return first


@contextlib.contextmanager
def applied(rule: Rule) -> Iterator[None]:
    """``rule``'s module settings for the duration (each restored after)."""
    settings: list[tuple[object, str, object]] = [
        (gemm_tuning, "SMALL_WEIGHT_BYTES", rule.weight_bytes),
        (gemm_launch, "LONG_SPLIT_K", rule.long_split_k),
        (small_gemm, "PREFETCH_K", rule.prefetch_k),
        (attention_launch, "WAVES", rule.attention_waves),
        (attention_launch, "UNSPLIT_WARPS", rule.unsplit_attention_warps),
        (attention_launch, "SPLIT_STAGES", rule.split_attention_stages),
        (launch, "PDL_MAX_ROWS", rule.pdl_max_rows),
        (decoder, "ROW_STATS", rule.row_stats),
        (gemm_launch, "UNSPLIT_STAGES", rule.unsplit_stages),
        (launch, "TRIGGER_FIRST", rule.trigger_first),
        (gemm_launch, "RESIDENT_MAX_ROWS", rule.resident_max_rows),
        (gemm_launch, "RESIDENT_MAX_BYTES", rule.resident_max_bytes),
        (gemm_launch, "SMEM_MAX_TILES", rule.smem_tiles),
        (gemm_launch, "RESIDENT_WIDE", rule.resident_wide),
        (attention_launch, "EARLY_KEYS", rule.early_keys),
        (attention_launch, "MAX_SPLITS", rule.attention_max_splits),
        (gemm_tuning, "PLAN_LM_HEAD", rule.plan_lm_head),
        (decoder, "EMBED_ROPE", rule.embed_rope and rule.rope_table),
    ]
    changes: list[Change] = [_narrow_gate_up] if rule.narrow_gate_up else []
    if rule.attention_trigger_first == "merge":
        merge = _merge_first(paged_attention._merge_splits)
        settings.append((paged_attention, "_merge_splits", merge))
    elif rule.attention_trigger_first == "both":
        settings.append((paged_attention, "pdl_arg", _trigger_first))
    if rule.split_attention_tile is not None:
        settings.append((paged_attention, "launch_for", _split_tile(*rule.split_attention_tile)))
    if not rule.rope_table:
        settings.append((decoder.DecoderModel, "rope", _computed_rope))
    if not rule.outputs_in_place:
        settings.append((runner, "_static_rows", lambda: (None, None)))
    if not rule.smem:
        settings.append((gemm_launch, "smem_config", lambda *_: None))
    if rule.qkv_splits:
        settings.append((gemm_launch, "rope_split_k", lambda *_: rule.qkv_splits))
    if rule.eight_split_steps is not None:
        block_k, stages = rule.eight_split_steps
        extra = tuple(
            replace(c, block_k=block_k, num_stages=stages)
            for c in gemm_launch.CONFIGS
            if c.split_k == 8 and not c.resident
        )
        _with_configs(settings, extra)
        changes.append(_eight_split_steps(block_k, stages))
    if rule.lm_head_tile is not None:
        n, warps, block_k = rule.lm_head_tile
        tile = gemm_launch.GemmConfig(n, 1, num_warps=warps, block_k=block_k)
        _with_configs(settings, (tile,))
        changes.append(_lm_head_tile(tile))
    if rule.resplit is not None:
        changes.append(_resplit(*rule.resplit))
    if changes:
        settings.append((gemm_launch, "pick_config", _repick(gemm_launch.pick_config, changes)))
    with contextlib.ExitStack() as stack:
        for module, name, value in settings:
            stack.enter_context(mock.patch.object(module, name, value))
        yield


def timings(model: dict, sizes: tuple[int, ...], rule: Rule, profile: bool = False) -> list[Timing]:
    """The default variant's step at ``sizes`` under ``rule``."""
    return timings_under(model, sizes, rule.name, applied(rule), profile)


def timings_under(
    model: dict,
    sizes: tuple[int, ...],
    name: str,
    settings: contextlib.AbstractContextManager,
    profile: bool = False,
) -> list[Timing]:
    """The default variant's step at ``sizes`` built and timed inside ``settings``; with
    ``profile``, its kernels counted after the timing (``decode.run``). A profiler
    session leaves later launches slower on the host (``benchmarks.profiler_effect``), so
    with it every rule after the first is timed in that state."""
    with settings:
        cfg = decode.BenchConfig(model=model, batch_sizes=sizes, variants=(VARIANT,))
        result = decode.run(cfg, torch.device("cuda"), log=lambda _: None, profile=profile)
    rows = [r for r in result.rows if r.variant == VARIANT]
    names = result.kernels_by_name
    return [
        Timing(
            name,
            r.batch,
            r.step_ms,
            r.pipelined_ms,
            r.kernels_in_layer,
            [(k.name, k.per_step, k.us_per_step) for k in names.get(f"{VARIANT} B={r.batch}", [])],
        )  # fmt: skip
        for r in rows
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--shape", default="llama-1.5b")
    parser.add_argument("--rules", choices=sorted(RULES), default="steps")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="count each rule's kernels too (the profiler slows the rules timed after it)",
    )
    args = parser.parse_args()
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    model = model_config(SMOLLM2_CONFIG if args.shape == "smollm2" else args.shape)
    doc = {"benchmark": "launch_rules", "shape": args.shape, "rules": args.rules}
    doc["provenance"] = asdict(Provenance.collect())
    doc["timings"] = []
    rules = RULES[args.rules]
    for rule in (*rules, rules[0]):
        for t in timings(model, sizes, rule, args.profile):
            doc["timings"].append(asdict(t))
            piped = t.pipelined_ms or float("nan")
            print(f"{t.rule:32s} B={t.batch:3d} {t.step_ms:7.3f} ms (piped {piped:.3f}) "
                  f"{t.kernels_in_layer} kernels/layer", flush=True)  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=1) + "\n")  # what a time limit leaves
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
