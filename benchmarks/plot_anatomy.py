"""Plots ``python -m benchmarks.kernel_anatomy`` results: per shape, each kernel's parts
(µs, one bar each, built up left to right) with its weight-read floor; with a second
result, its full kernel (the last part) beside, hatched, labelled ``before``.
Usage: python -m benchmarks.plot_anatomy OUT.png RESULT.json [BEFORE.json] [--rows N]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _by_part(path: Path, rows: int) -> dict[str, dict[str, list[dict]]]:
    """shape -> kernel -> its timings at ``rows``, in the benchmark's order."""
    out: dict[str, dict[str, list[dict]]] = {}
    for t in json.loads(path.read_text())["timings"]:
        if t["rows"] == rows:
            out.setdefault(t["shape"], {}).setdefault(t["kernel"], []).append(t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("result", type=Path)
    parser.add_argument("before", type=Path, nargs="?")
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    now = _by_part(args.result, args.rows)
    before = _by_part(args.before, args.rows) if args.before else {}
    fig, axes = plt.subplots(1, len(now), figsize=(7 * len(now), 4.5), squeeze=False)
    for ax, (shape, kernels) in zip(axes[0], now.items(), strict=True):
        for g, (kernel, parts) in enumerate(kernels.items()):
            bars = parts + ([before[shape][kernel][-1]] if before else [])
            width = 0.8 / len(bars)
            for i, t in enumerate(bars):
                old = i == len(parts)
                x = g + i * width
                ax.bar(x, t["us"], width, hatch="//" if old else None, color=f"C{i}")
                label = "before" if old else t["part"]
                ax.annotate(label, (x, t["us"]), ha="center", va="bottom", rotation=90, fontsize=7)
            ax.hlines(parts[0]["floor_us"], g - width / 2, g + 0.8 - width / 2, colors="k")
        ax.set_xticks([g + 0.4 - 0.4 / len(k) for g, k in enumerate(kernels.values())])
        ax.set_xticklabels(list(kernels))
        ax.set_ylabel("µs per call (cold weights, PDL chain)")
        ax.set_title(f"{shape}, {args.rows} row(s); black line: weight bytes / copy bandwidth")
    prov = json.loads(args.result.read_text())["provenance"]
    fig.suptitle(f"{prov['device']}, torch {prov['torch']}, {prov['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
