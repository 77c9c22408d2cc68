"""A decode step under other launch rules for ostinato's kernels, one run: each rule is
a ``LaunchRules`` (``dataclasses.replace`` of the library's) put in force while the
step is built, captured and timed (``rules_in_force``); nothing is patched. The sets
vary which projections run the Triton GEMM without a measurement
(``small_weight_bytes``), long splits' K steps (``long_split_k``), the weight prefetch
before the PDL wait (``prefetch_k``), attention's split count, warps, stages, key tile
and early keys, the largest step launched with PDL (``pdl_max_rows``) and the order of
its trigger and wait (``trigger_first``), the norms' row statistics (``row_stats``), an
unsplit projection's stages (``unsplit_stages``), the resident and shared-memory
launches' rows, bytes and warps, the planned LM head (``plan_lm_head``) and the one-kernel
embedding and RoPE rows (``embed_rope``). The first rule of a set runs again last, so
drift shows as A against A. (Sets that changed code rather than a rule, such as other
GEMM tiles per projection, ran at earlier commits; RESULTS.md keeps their numbers.)

``python -m benchmarks.launch_rules --out results.json [--batch-sizes 1,8,16]
[--rules steps|sizes|attention|attention-stages|pdl-rows|row-stats|row-stats-six|
unsplit-stages|pdl-order|resident|resident-rows|resident-down|early-keys|
attention-splits|attention-tile-rule|prefetch|prefetch-long|resident-warps|lm-head|
embed-rope|smem|smem-two] [--shape llama-1.5b|smollm2] [--variant "ostinato FULL"]
[--profile]``

The step is ``benchmarks.decode``'s ``--variant``: by default "ostinato FULL", the
engine's default mode (the sets up to the FULL default ran "ostinato FULL_AND_PIECEWISE").
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from benchmarks import DEFAULT_SHAPE, decode
from benchmarks.decode import SMOLLM2_CONFIG, model_config
from ostinato.engine.kernels.launch_rules import LaunchRules, rules_in_force
from ostinato.provenance import Provenance


@dataclass(frozen=True)
class Timing:
    rule: str
    batch: int
    step_ms: float
    pipelined_ms: float | None
    kernels_in_layer: int | None
    # [kernel name, launches per step, µs per step] from the step's device profile
    kernels: list[tuple[str, float, float]]


VARIANT = "ostinato FULL"  # the engine's default mode
MiB = 1 << 20
OFF = 1 << 30  # a bound no step or weight reaches: the rule never applies
DEFAULT = LaunchRules()


@dataclass(frozen=True)
class Rule:
    """One setting of the launch rules, named: ``LaunchRules()`` with ``changes``."""

    name: str
    rules: LaunchRules = field(default_factory=LaunchRules)


def rule(name: str, **changes: object) -> Rule:
    """``name`` for the library's launch rules with ``changes`` (``dataclasses.replace``:
    a misspelt field fails here, not in the run)."""
    return Rule(name, replace(DEFAULT, **changes))


# The sets "steps" and "sizes" were measured before the attention rule changed: they
# keep the attention launch of then.
_OLD = dict(attention_waves=2, unsplit_attention_warps=4, split_attention_stages=3)
_FUSED = dict(small_weight_bytes=64 * MiB, **_OLD)
RULES: dict[str, tuple[Rule, ...]] = {
    # Plain projections (O, down) of 3 to 8 rows with their weight in shared memory
    # across the PDL wait (``smem_gemm``), or the K loop.
    "smem": (
        rule("shared-memory launch from 3 rows"),
        rule("K loop from 3 rows", smem_max_rows=0),
    ),
    # Only the plain projections in shared memory, or QKV (RoPE, the K/V write) and
    # gate/up (SwiGLU) too.
    "smem-two": (
        rule("plain projections only"),
        rule("QKV and gate/up in shared memory too", smem_max_tiles=2),
    ),
    # A step's embedding rows and RoPE table rows: one kernel launched with PDL, or
    # torch's two lookups.
    "embed-rope": (
        rule("embeddings and RoPE rows in one kernel"),
        rule("two lookups", embed_rope=False),
    ),
    # The final norm inside the LM head's kernel (planned where its weight is at most
    # 64 MiB: SmolLM2's), or a norm kernel then cuBLAS; and any LM head planned.
    "lm-head": (
        rule("final norm in the LM head", plan_lm_head=True),
        rule("norm kernel, cuBLAS LM head", plan_lm_head=False),
        rule("final norm in any LM head", small_weight_bytes=OFF, plan_lm_head=True),
    ),
    "steps": (
        rule("8 MiB, K step 128", small_weight_bytes=8 * MiB, long_split_k=OFF, **_OLD),
        rule("8 MiB, long splits step 256", small_weight_bytes=8 * MiB, **_OLD),
        rule("64 MiB, K step 128", long_split_k=OFF, **_FUSED),
        rule("64 MiB, long splits step 256", **_FUSED),
        rule("64 MiB, 256, prefetch 2048", prefetch_k=2048, **_FUSED),
    ),
    # One projection more at a time: QKV (12 MiB), down (32 MiB).
    "sizes": (
        rule("8 MiB, K step 128", small_weight_bytes=8 * MiB, long_split_k=OFF, **_OLD),
        rule("12 MiB, 256", small_weight_bytes=12 * MiB, **_OLD),
        rule("32 MiB, 256", small_weight_bytes=32 * MiB, **_OLD),
    ),
    # Attention's split count for about two waves or four, 4 or 2 warps unsplit (split
    # launches then had 3 stages).
    "attention": (
        rule("attention 2 waves, 4 warps", **_OLD),
        rule("attention 4 waves, 2 warps unsplit", split_attention_stages=3),
    ),
    "attention-stages": (
        rule("split attention 3 stages", split_attention_stages=3),
        rule("split attention 2 stages", split_attention_stages=2),
    ),
    # Row statistics handed to the norms against norms that pass over their rows; with
    # them, six kernels a layer at the 1.5 B shape (64 MiB).
    "row-stats": (
        rule("norms pass over their rows", row_stats=False),
        rule("row statistics", row_stats=True),
    ),
    "row-stats-six": (
        rule("8 MiB, norms pass over their rows", small_weight_bytes=8 * MiB, row_stats=False),
        rule("8 MiB, row statistics", small_weight_bytes=8 * MiB),
        rule("64 MiB, row statistics"),
    ),
    # An unsplit plain projection's pipeline in 3 stages or all its steps in flight.
    "unsplit-stages": (
        rule("unsplit plain: 3 stages", unsplit_stages=3),
        rule("unsplit plain: 4 stages", unsplit_stages=4),
    ),
    # A kernel lets the next launch after its PDL wait or before it, and with that a
    # longer prefetch.
    "pdl-order": (
        rule("wait, then launch dependents", trigger_first=False),
        rule("launch dependents, then wait", trigger_first=True),
        rule("launch first, prefetch 2048", trigger_first=True, prefetch_k=2048),
    ),
    # One- and two-row projections with their weight held in registers (none, those of
    # at most 16 MiB, all that fit a program).
    "resident": (
        rule("no resident launch", resident_max_rows=0),
        rule("resident up to 16 MiB"),
        rule("resident, any weight", resident_max_bytes=OFF),
    ),
    "resident-rows": (
        rule("resident at 1 row", resident_max_rows=1),
        rule("resident up to 2 rows", resident_max_rows=2),
        rule("resident up to 4 rows", resident_max_rows=4),
    ),
    # The 1.5 B down projection (32 MiB) resident too, its gate/up (64 MiB) not.
    "resident-down": (
        rule("resident up to 16 MiB"),
        rule("resident up to 32 MiB", resident_max_bytes=32 * MiB),
    ),
    # Attention reads its first tile's older keys before its PDL wait, or waits first.
    "early-keys": (
        rule("attention waits first", early_keys=False),
        rule("older keys before the wait"),
    ),
    # At most 16 splits of a token's keys, or at most 8 or 4: fewer partials to merge.
    "attention-splits": (
        rule("attention: at most 16 splits"),
        rule("attention: at most 8 splits", attention_max_splits=8),
        rule("attention: at most 4 splits", attention_max_splits=4),
    ),
    # The key tile by rule (wider where keys are read before the wait) against 64 keys
    # in 4 warps everywhere.
    "attention-tile-rule": (
        rule("attention tile by rule"),
        rule("attention tile 64, 4 warps", early_tile=64, few_pairs=0),
    ),
    # A K-loop program's weight prefetch before its PDL wait: 512 columns a row or 128.
    "prefetch": (
        rule("prefetch 512 columns"),
        rule("prefetch 128 columns", prefetch_k=128),
    ),
    # Longer prefetches, for the 8 B shape's QKV and O (50 and 32 MiB, streamed at two
    # thirds of the copy bandwidth in its one-row step): half of K, or all of it, before
    # the wait; and half with the dependents launched first.
    "prefetch-long": (
        rule("prefetch 512 columns"),
        rule("prefetch 2048 columns", prefetch_k=2048),
        rule("prefetch 4096 columns", prefetch_k=4096),
        rule("launch first, prefetch 2048", trigger_first=True, prefetch_k=2048),
    ),
    # A resident program holding more than 8192 weight elements in 8 warps, or in 4.
    "resident-warps": (
        rule("resident: 8 warps above 8192"),
        rule("resident: 4 warps", resident_wide=OFF),
    ),
    # PDL for steps of more than 16 rows too (run with --batch-sizes 32,128).
    "pdl-rows": (
        rule("PDL up to 16 rows", pdl_max_rows=16),
        rule("PDL at every row count", pdl_max_rows=OFF),
    ),
}


def timings(
    model: dict, sizes: tuple[int, ...], rule: Rule, profile: bool = False, variant: str = VARIANT
) -> list[Timing]:
    """``variant``'s step at ``sizes`` built and timed with ``rule`` in force;
    with ``profile``, its kernels counted after the timing (``decode.run``). A profiler
    session leaves later launches slower on the host (``benchmarks.profiler_effect``), so
    with it every rule after the first is timed in that state."""
    with rules_in_force(rule.rules):
        cfg = decode.BenchConfig(model=model, batch_sizes=sizes, variants=(variant,))
        result = decode.run(cfg, torch.device("cuda"), log=lambda _: None, profile=profile)
    rows = [r for r in result.rows if r.variant == variant]
    names = result.kernels_by_name
    return [
        Timing(
            rule.name,
            r.batch,
            r.step_ms,
            r.pipelined_ms,
            r.kernels_in_layer,
            [(k.name, k.per_step, k.us_per_step) for k in names.get(f"{variant} B={r.batch}", [])],
        )  # fmt: skip
        for r in rows
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--shape", default=DEFAULT_SHAPE)
    parser.add_argument("--rules", choices=sorted(RULES), default="steps")
    parser.add_argument("--variant", default=VARIANT, choices=decode.RUNNER_VARIANTS)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="count each rule's kernels too (the profiler slows the rules timed after it)",
    )
    args = parser.parse_args()
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    model = model_config(SMOLLM2_CONFIG if args.shape == "smollm2" else args.shape)
    doc = {"benchmark": "launch_rules", "shape": args.shape, "rules": args.rules}
    doc["variant"] = args.variant
    doc["settings"] = {r.name: asdict(r.rules) for r in RULES[args.rules]}
    doc["provenance"] = asdict(Provenance.collect())
    doc["timings"] = []
    rules = RULES[args.rules]
    for rule in (*rules, rules[0]):
        for t in timings(model, sizes, rule, args.profile, args.variant):
            doc["timings"].append(asdict(t))
            piped = t.pipelined_ms or float("nan")
            print(f"{t.rule:32s} B={t.batch:3d} {t.step_ms:7.3f} ms (piped {piped:.3f}) "
                  f"{t.kernels_in_layer} kernels/layer", flush=True)  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=1) + "\n")  # what a time limit leaves
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
