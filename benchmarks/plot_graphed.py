"""Plots a ``python -m benchmarks.graphed_models`` result: per model, mean ms per call at
each batch size of the stream for every system (each size alone where the result has
those medians), with each system's warm-up seconds, peak memory and graph count in the
legend. Several results (one model each) plot side by side.
Usage: python -m benchmarks.plot_graphed OUT.png RESULT.json [RESULT.json ...]"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def legend(row: dict) -> str:
    graphs = f", {row['graphs']} graphs" if row.get("graphs") is not None else ""
    peak = f", peak {row['peak_mib']:.0f} MiB" if row.get("peak_mib") else ""
    return f"{row['system']} (warm-up {row['warmup_s']:.1f} s{peak}{graphs})"


def main(out: str, *paths: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.loads(Path(p).read_text()) for p in paths]
    rows = [r for doc in docs for r in doc["rows"]]
    doc = docs[0]
    models = list(dict.fromkeys(r["model"] for r in rows))
    cols = min(3, len(models))
    grid = (-(-len(models) // cols), cols)
    fig, axes = plt.subplots(*grid, figsize=(5.5 * cols, 4.2 * grid[0]), squeeze=False)
    for ax in axes.flat[len(models) :]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models, strict=False):
        for row in (r for r in rows if r["model"] == model):
            by_size = row.get("median_ms_by_size") or row["ms_by_batch"]
            points = sorted((int(b), ms) for b, ms in by_size.items())
            ax.plot(*zip(*points, strict=True), marker=".", label=legend(row))
        ax.set_title(model)
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms per call (warm)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    prov = doc["provenance"]
    fig.suptitle(
        f"ostinato.graphed on {prov.get('device', '?')}, {doc['dtype']}, torch "
        f"{prov.get('torch', '?')}, commit {prov.get('commit', '?')[:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
