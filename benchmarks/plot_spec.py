"""Plots an ``python -m benchmarks spec`` result: tokens/s per proposer at each batch size
(one panel per k), with each bar's acceptance rate above it and draft-graph timings in
the title. Usage: python -m benchmarks.plot_spec OUT.png RESULT.json"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(path).read_text())
    rows = doc["rows"]
    plain = [r for r in rows if r["proposer"] == "none"]
    ks = sorted({r["k"] for r in rows if r["proposer"] != "none"})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(ks), figsize=(8 * len(ks), 4.5), squeeze=False)
    for ax, k in zip(axes[0], ks, strict=True):
        series = [("none", plain)] + [
            (name, [r for r in rows if r["proposer"] == name and r["k"] == k])
            for name in dict.fromkeys(r["proposer"] for r in rows if r["k"] == k)
        ]
        width = 0.8 / len(series)
        for i, (name, rs) in enumerate(series):
            xs = [batches.index(r["batch"]) + i * width for r in rs]
            bars = ax.bar(xs, [r["tokens_per_s"] for r in rs], width, label=name)
            for bar, r in zip(bars, rs, strict=True):
                if name != "none":
                    ax.annotate(
                        f"{r['acceptance_rate']:.0%}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks([b + 0.4 - width / 2 for b in range(len(batches))])
        ax.set_xticklabels([f"B={b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("generated tokens/s (log)")
        ax.set_title(f"k={k}: label = acceptance rate")
        ax.legend(fontsize=8)
    prov = doc["provenance"]
    fig.suptitle(
        f"{doc['model']} {doc['dtype']} {doc['mode']}, {doc['new_tokens']} new tokens "
        f"(EOS ignored)\n{prov['device']}, torch {prov['torch']}, {prov['commit'][:7]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
