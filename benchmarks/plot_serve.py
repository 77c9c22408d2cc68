"""Plots server throughput over offline ``generate`` against the number of concurrent
clients, per model and phase, from ``serve_load`` results (bars: the whole phase;
dots: its steady window). Usage: python -m benchmarks.plot_serve OUT.png JSON..."""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGET = 0.85  # the ratio at 32 clients that serving must reach


def main(out: str, paths: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.loads(Path(p).read_text()) for p in paths]
    fig, axes = plt.subplots(1, len(docs), figsize=(6 * len(docs), 4), squeeze=False)
    for ax, doc in zip(axes[0], docs, strict=True):
        clients = sorted({r["clients"] for r in doc["rows"]})
        width = 0.38
        for k, phase in enumerate(("fixed", "mixed")):
            rows = {r["clients"]: r for r in doc["rows"] if r["phase"] == phase}
            xs = [i + (k - 0.5) * width for i in range(len(clients))]
            ax.bar(xs, [rows[n]["ratio"] for n in clients], width, label=f"{phase}: whole phase")
            steady = [rows[n]["steady_ratio"] for n in clients]
            ax.plot(xs, steady, "o", color=f"C{k}", markeredgecolor="k", label=f"{phase}: steady")
        ax.axhline(TARGET, color="k", linestyle="--", linewidth=1, label=f"target {TARGET}")
        ax.set_xticks(range(len(clients)), [str(n) for n in clients])
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel("server tokens/s over offline generate")
        weights = " (random weights)" if doc["random_weights"] else ""
        ax.set_title(f"{doc['model']}{weights}, {doc['provenance']['device']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
