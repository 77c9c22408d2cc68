"""Where a tensor-parallel decode step spends its device time, next to the one-GPU step:
the kernel census of ``python -m benchmarks --tp N`` (``kernels_by_name``) summed by
kind of kernel, per rank and step.

Usage: ``python -m benchmarks.tp_breakdown TP1.json TP2.json [--plot OUT.png]``; prints a
Markdown table per batch size.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

# Kinds, first match wins (lower-case substrings of the kernel names).
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("all-reduce", ("allreduce", "all_reduce", "memcpy32_post", "allgather")),
    ("GEMM", ("nvjet", "gemm", "splitkreduce", "cutlass", "sm90_xmma")),
    ("attention", ("paged_attention", "merge_splits", "write_kv")),
    ("RMSNorm", ("rms_norm",)),
    ("SiLU*mul", ("silu",)),
)
OTHER = "other"


def kind_of(name: str) -> str:
    """The kind a kernel name belongs to (``OTHER`` when none matches)."""
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return OTHER


@dataclass(frozen=True)
class Breakdown:
    """One step's device time by kind (µs) and kernel launches by kind."""

    tp: int
    batch: int
    all_reduce: str  # "[nccl]", "[auto]", ...; "" at TP=1 and in older TP results
    step_ms: float
    us: dict[str, float]
    launches: dict[str, float]

    @property
    def busy_us(self) -> float:
        return sum(self.us.values())


def breakdowns(doc: dict) -> list[Breakdown]:
    """Every ``kernels_by_name`` entry of a decode result, summed by kind."""
    steps = {(r["variant"], r["batch"]): r["step_ms"] for r in doc["rows"]}
    out = []
    for key, kernels in doc.get("kernels_by_name", {}).items():
        # "ostinato FULL B=1", or under TP "ostinato FULL B=1 [nccl]" for variant
        # "ostinato FULL [nccl]" (older TP results: the first all-reduce's, unnamed)
        name, rest = key.rsplit(" B=", 1)
        batch_s, _, choice = rest.partition(" ")
        batch = int(batch_s)
        variant = f"{name} {choice}" if choice else name
        step = steps.get((variant, batch))
        if step is None:
            step = next(ms for (v, b), ms in steps.items() if b == batch and v.startswith(variant))
        us = dict.fromkeys([k for k, _ in KINDS] + [OTHER], 0.0)
        launches = dict.fromkeys(us, 0.0)
        for k in kernels:
            kind = kind_of(k["name"])
            us[kind] += k["us_per_step"]
            launches[kind] += k["per_step"]
        out.append(Breakdown(doc["tensor_parallel_size"], batch, choice, step, us, launches))
    return out


def table(rows: list[Breakdown]) -> str:
    """A Markdown table: per TP and batch, the step, each kind's µs (launches), the gaps."""
    kinds = list(rows[0].us)
    head = "| TP | B | algorithm | step ms | " + " | ".join(kinds) + " | idle between kernels |"
    lines = [head, "|" + " --- |" * (len(kinds) + 5)]
    for r in rows:
        algo = r.all_reduce.strip("[]") or ("-" if r.tp == 1 else "nccl")
        cells = [f"{r.us[k]:.0f} ({r.launches[k]:.0f})" for k in kinds]
        idle = r.step_ms * 1000 - r.busy_us
        lines.append(
            f"| {r.tp} | {r.batch} | {algo} | {r.step_ms:.3f} | "
            + " | ".join(cells)
            + f" | {idle:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[Breakdown], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"TP={r.tp} B={r.batch} {r.all_reduce}".strip() for r in rows]
    bottoms = [0.0] * len(rows)
    for kind in [*rows[0].us, "idle"]:
        heights = [
            (r.step_ms * 1000 - r.busy_us if kind == "idle" else r.us[kind]) / 1000 for r in rows
        ]
        ax.bar(labels, heights, bottom=bottoms, label=kind)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_ylabel("ms per decode step (one rank)")
    ax.set_title("decode step, FULL graphs: device time by kernel kind")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    rows = [b for p in args.results for b in breakdowns(json.loads(p.read_text()))]
    rows.sort(key=lambda r: (r.batch, r.tp))
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
