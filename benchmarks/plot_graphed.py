"""Plots a ``python -m benchmarks.graphed_models`` result: per model, mean ms per call at
each batch size of the stream for every system, with each system's warm-up seconds and
graph count in the legend. Usage: python -m benchmarks.plot_graphed OUT.png RESULT.json"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def legend(row: dict) -> str:
    graphs = f", {row['graphs']} graphs" if row.get("graphs") is not None else ""
    return f"{row['system']} (warm-up {row['warmup_s']:.1f} s{graphs})"


def main(out: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(path).read_text())
    models = list(dict.fromkeys(r["model"] for r in doc["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for row in (r for r in doc["rows"] if r["model"] == model):
            points = sorted((int(b), ms) for b, ms in row["ms_by_batch"].items())
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
