"""How the small GEMM (``small_gemm``) is launched: its row tile, its candidate configs and
the choice made without a measurement. Plain Python, importable without Triton."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ostinato.engine.kernels.launch_rules import rules
from ostinato.mathutil import ceil_div

MAX_ROWS = 16  # the one row tile of the GEMM (tl.dot's smallest M)
BLOCK_K = 128  # K columns per step of its loop
MAX_SPLIT_K = 8
# Output columns per entry of the row statistics: the narrowest tile's width, or the
# resident tile's at the rows it runs (``stats_granule``). Finer entries cost the norm
# that reads them a larger load: at 4 columns for every row count the 1.5 B step was 2%
# slower at 8 and 16 rows on the H200.
GRANULE = 16
# K columns per loop step of an unsplit gate/up projection (two tiles per program): on
# the H200, with each call reading its own weight (``fused_sweep --cold``), 256 beat 128
# by 10% at the SmolLM2 shape (6.3 vs 7.0 µs) and 44% at the 1.5 B shape's 32-column
# tiles (22.8 vs 40.7 µs). SmolLM2's single-tile projections were level or better at
# 128; the 1.5 B shape's (cuBLAS by default) were faster at 256 too, not yet taken up.
SWIGLU_BLOCK_K = 256
# A *resident* launch (``LaunchRules.resident_max_rows`` rows): each program holds
# RESIDENT_N weight rows per tile over the whole of K in registers, loaded before its PDL
# wait, and multiplies on CUDA cores after it: no K loop, no split-K reduction. On the
# H200 (cold weights, one row) it took the 1.5 B shape's QKV from 8.0 to 3.9 µs, O 5.7 to
# 2.9, down 12.1 to 8.9, gate/up 17.8 to 16.4, and SmolLM2's four from 2.5-3.7 to 1.2-2.2.
RESIDENT_N = 4
RESIDENT_ELEMENTS = 32768  # weight elements a program holds at most (64 KiB of 16-bit)
# A *shared-memory* launch (``smem_gemm``, Gluon; ``LaunchRules.smem_max_rows``): each
# program copies SMEM_N weight rows over the whole of K into shared memory before its
# PDL wait and multiplies them on tensor cores after it. On the H200 (cold weights) it
# beat the K loop at 8 and 16 rows for every plain shape tried whose tiles fit (the 1.5 B
# shape's O 3.54 against 5.71 µs at 8 rows), and the resident launch at 2 rows; it starts
# above the resident rows, where the row statistics' granule is its tile width.
SMEM_N = GRANULE
SMEM_BYTES = 227 * 1024  # shared memory a program may hold on an H100 or H200


# The small GEMM's epilogues (``small_gemm``): one tile stored (plus the bias), gate/up's
# ``silu(gate) * up`` of two tiles, a QKV head's two halves with RoPE and the K/V write.
PLAIN, SWIGLU, ROPE_KV = 0, 1, 2


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape of the small GEMM: output columns per program, K splits, warps,
    K columns per loop step, software-pipeline stages; or ``resident`` (at most
    ``LaunchRules.resident_max_rows`` rows): the weight tile over the whole of K held in registers
    (``RESIDENT_N``)."""

    block_n: int
    split_k: int
    num_warps: int = 4
    block_k: int = 128
    num_stages: int = 3
    resident: bool = False
    smem: bool = False


# The candidates the start-up measurement tries (``gemm_tuning``); a plan entry ``i > 0``
# names ``CONFIGS[i - 1]``, 0 names cuBLAS (cached plans hold these indices: new
# entries go last). On the H100 the narrow 16-column tiles never won, so they are not
# tried. Entries 5 to 9 are the shapes ``pick_config`` may name that the first four
# lack; 10 to 12 its gate/up shapes, which step 256 columns at a time; 13 to 18 its split
# shapes with long splits (``k_step``); 19 its unsplit plain shape in 4 stages
# (``LaunchRules.unsplit_stages``);
# 20 and 21 the resident shapes (``resident_config``), 22 the shared-memory shape
# (``smem_config``).
CONFIGS: tuple[GemmConfig, ...] = (
    GemmConfig(32, 1),
    GemmConfig(32, 4),
    GemmConfig(64, 1),
    GemmConfig(64, 2),
    GemmConfig(32, 2),
    GemmConfig(32, 8),
    GemmConfig(64, 4),
    GemmConfig(64, 8),
    GemmConfig(64, 1, num_warps=8),
    GemmConfig(32, 1, block_k=SWIGLU_BLOCK_K),
    GemmConfig(64, 1, block_k=SWIGLU_BLOCK_K),
    GemmConfig(64, 1, num_warps=8, block_k=SWIGLU_BLOCK_K),
    *(GemmConfig(n, s, block_k=256) for n in (32, 64) for s in (2, 4, 8)),
    GemmConfig(32, 1, num_stages=4),
    GemmConfig(RESIDENT_N, 1, num_warps=4, resident=True),
    GemmConfig(RESIDENT_N, 1, num_warps=8, resident=True),
    GemmConfig(SMEM_N, 1, num_warps=4, smem=True),
)
UNSPLIT_K = 1024  # a K this short is read by one program per column tile
SPLIT_K_COLUMNS = 512  # a longer K is split into pieces of at most this many columns


def k_per_split(k: int, split_k: int, block_k: int = BLOCK_K) -> int:
    """Columns of K per split, in whole ``block_k`` tiles."""
    return ceil_div(ceil_div(k, split_k), block_k) * block_k


def working_splits(k: int, split_k: int) -> int:
    """How many of ``split_k`` splits get columns (the last ones may get none)."""
    return ceil_div(k, k_per_split(k, split_k))


def k_step(k: int, split_k: int) -> int:
    """K columns per loop step of a projection over ``k`` in ``split_k`` splits: 256 where
    each split is at least ``LaunchRules.long_split_k`` columns and a whole number of
    256-column steps, else ``BLOCK_K``."""
    per = k_per_split(k, split_k)
    return 256 if per >= rules().long_split_k and per % 256 == 0 else BLOCK_K


def pick_config(n: int, k: int, sms: int, swiglu: bool = False) -> int:
    """The plan entry (1-based into ``CONFIGS``) used without a measurement for ``n``
    output columns over ``k`` (per tile: gate/up's ``n`` is its intermediate size, with
    ``swiglu``), the rule the H200 sweep of the fused kernels suggested
    (``benchmarks/fused_sweep.py``): where 64-column tiles give at least every other SM
    a program, those, unsplit, with 8 warps (LM heads), or for ``swiglu`` 32-column
    tiles with 4 warps (gate/up, two tiles a program); else K unsplit up to
    ``UNSPLIT_K`` columns (a split's reduction costs more than a short loop), or split in
    powers of two until a split has at most ``SPLIT_K_COLUMNS`` (at most ``MAX_SPLIT_K``),
    in 32-column tiles unless those would give more than two programs per SM. An
    unsplit ``swiglu`` projection steps ``SWIGLU_BLOCK_K`` columns at a time, any other
    ``k_step``'s; an unsplit plain one of 32-column tiles stepping ``BLOCK_K`` pipelines
    ``LaunchRules.unsplit_stages`` stages.
    Deterministic in ``(n, k, sms, swiglu)``."""
    if swiglu and 2 * ceil_div(n, 64) >= sms:
        # gate/up reads two tiles a program: in 32 columns, 1.009 against 1.081 ms for
        # the 1.5 B shape's step at B = 1 (1.113 against 1.170 at 8; H200, launch_rules
        # --rules row-stats-six)
        config = GemmConfig(32, 1)
    elif 2 * ceil_div(n, 64) >= sms:
        config = GemmConfig(64, 1, num_warps=8)
    else:
        split = 1
        if k > UNSPLIT_K:
            while split < MAX_SPLIT_K and k_per_split(k, split) > SPLIT_K_COLUMNS:
                split *= 2
        wide = ceil_div(n, 32) * working_splits(k, split) > 2 * sms
        config = GemmConfig(64 if wide else 32, split)
    if swiglu and config.split_k == 1:
        config = replace(config, block_k=SWIGLU_BLOCK_K)
    else:
        config = replace(config, block_k=k_step(k, config.split_k))
    if not swiglu and config == GemmConfig(32, 1):
        config = replace(config, num_stages=rules().unsplit_stages)
    return CONFIGS.index(config) + 1


def resident_elements(k: int, tiles: int = 1) -> int:
    """Weight elements a resident program holds: ``tiles`` tiles (two for gate/up and
    QKV's half heads) of ``RESIDENT_N`` rows over K padded to a power of two."""
    return tiles * RESIDENT_N * (1 << max(k - 1, 0).bit_length())


def resident_config(k: int, tiles: int = 1, weight_bytes: int = 0, rows: int = 1) -> int | None:
    """The plan entry (1-based into ``CONFIGS``) of the resident launch for ``rows`` rows
    of a projection of ``weight_bytes`` over ``k`` columns whose programs hold ``tiles``
    tiles, or None where ``fits`` refuses it (more rows than the rules' resident rows,
    weight rows over a program's registers) or the weight is over
    ``LaunchRules.resident_max_bytes``."""
    r = rules()
    warps = 8 if resident_elements(k, tiles) > r.resident_wide else 4
    config = GemmConfig(RESIDENT_N, 1, num_warps=warps, resident=True)
    if weight_bytes > r.resident_max_bytes or not fits(config, rows, k, tiles):
        return None
    return CONFIGS.index(config) + 1


def fits(config: GemmConfig, rows: int, k: int, tiles: int = 1) -> bool:
    """Whether ``config`` may run a projection of ``rows`` rows over ``k`` columns whose
    programs hold ``tiles`` tiles: a resident one only up to ``LaunchRules.resident_max_rows`` rows
    and ``RESIDENT_ELEMENTS`` weight elements; a shared-memory one only as ``smem_fits``
    says; any other always."""
    if config.smem:
        return smem_fits(config, rows, k, tiles)
    if not config.resident:
        return True
    return rows <= rules().resident_max_rows and resident_elements(k, tiles) <= RESIDENT_ELEMENTS


def smem_k_step(k: int, warps: int) -> int:
    """K columns per tensor-core step of a shared-memory launch in ``warps`` warps (each
    owning ``k / warps`` columns): the most of 64, 32 and 16 that cut a warp's columns
    evenly, 0 where none does."""
    return next((s for s in (64, 32, 16) if k % (warps * s) == 0), 0)


def smem_bytes(config: GemmConfig, rows: int, k: int, tiles: int = 1) -> int:
    """Shared memory a program of the shared-memory ``config`` holds at ``rows`` rows:
    its ``tiles`` tiles of weight rows and the rows of x (padded to 8 or 16), each warp's
    columns padded to a power of two."""
    chunk = 1 << max(k // config.num_warps - 1, 0).bit_length()
    return (tiles * config.block_n + (8 if rows <= 8 else 16)) * config.num_warps * chunk * 2


def smem_fits(config: GemmConfig, rows: int, k: int, tiles: int = 1) -> bool:
    """Whether the shared-memory ``config`` takes ``rows`` rows over ``k`` columns with
    ``tiles`` tiles a program (1, or 2 for SwiGLU and RoPE), more rows than the resident
    launch takes up to ``LaunchRules.smem_max_rows``, ``k`` in whole steps, and its tiles
    within ``SMEM_BYTES``."""
    r = rules()
    return (
        tiles in (1, 2)
        and r.resident_max_rows < rows <= r.smem_max_rows
        and smem_k_step(k, config.num_warps) > 0
        and smem_bytes(config, rows, k, tiles) <= SMEM_BYTES
    )


def smem_config(k: int, tiles: int, rows: int, weight_bytes: int = 0) -> int | None:
    """The plan entry (1-based into ``CONFIGS``) of the shared-memory launch for ``rows``
    rows of a projection of ``weight_bytes`` over ``k`` columns whose programs hold
    ``tiles`` tiles, or None where it does not fit (``smem_fits``), the weight is over
    ``LaunchRules.smem_max_bytes`` or the tiles over ``smem_max_tiles``."""
    config = GemmConfig(SMEM_N, 1, num_warps=4, smem=True)
    r = rules()
    if tiles > r.smem_max_tiles or weight_bytes > r.smem_max_bytes:
        return None
    if not smem_fits(config, rows, k, tiles):
        return None
    return CONFIGS.index(config) + 1


def rope_head_dim(d: int) -> bool:
    """Whether the ROPE_KV epilogue takes heads of ``d`` dims: its programs own one head
    as two half-head tiles, and a tile is a power of two of at least 16 columns."""
    return d >= 32 and d & (d - 1) == 0


def rope_split_k(heads: int, k: int, sms: int) -> int:
    """K splits for the QKV projection whose programs each own one of ``heads`` heads: a
    power of two, doubled while the working programs leave SMs idle and doubling adds
    working splits, at most ``MAX_SPLIT_K``."""
    split = 1
    while (
        heads * working_splits(k, split) < sms
        and split < MAX_SPLIT_K
        and working_splits(k, 2 * split) > working_splits(k, split)
    ):
        split *= 2
    return split


def rope_config(
    heads: int, d: int, k: int, sms: int, rows: int, head_norms: bool = False,
    weight_bytes: int = 0,
) -> GemmConfig:  # fmt: skip
    """The ROPE_KV launch of a QKV projection of ``heads`` heads of ``d`` over ``k``
    columns (``weight_bytes`` in all): resident where ``resident_config`` takes its two
    half-head tiles, in shared memory where ``smem_config`` does (by default it does
    not: ``LaunchRules.smem_max_tiles``; neither with
    ``head_norms``, which need a program per head), else a program per head in
    ``rope_split_k`` splits."""
    choice = resident_config(k, 2, weight_bytes, rows) or smem_config(k, 2, rows, weight_bytes)
    if choice is not None and not head_norms:
        return CONFIGS[choice - 1]
    split = rope_split_k(heads, k, sms)
    return GemmConfig(d // 2, split, block_k=k_step(k, split))


def stats_granule(rows: int) -> int:
    """Columns per entry of the row statistics of ``rows`` rows: ``RESIDENT_N`` where a
    resident launch may store them (``LaunchRules.resident_max_rows``), else ``GRANULE``."""
    return RESIDENT_N if rows <= rules().resident_max_rows else GRANULE


def stats_columns(n: int, rows: int = 1) -> int:
    """Entries per row of the row statistics (sums of squares per ``stats_granule(rows)``
    columns) of ``rows`` rows of ``n`` columns, stored row after row; at the default
    (the finest granule) a buffer's width: ``small_gemm``'s ``ResidualStats`` and
    ``NormPrologue.stats`` take ``[MAX_ROWS, stats_columns(n)]``."""
    return ceil_div(n, stats_granule(rows))


def counters_needed(n: int) -> int:
    """Counter entries a projection with ``n`` output columns needs (one per column tile
    of the narrowest config; a QKV head spans at least one)."""
    return ceil_div(n, min(c.block_n for c in CONFIGS))
