"""Plots decode step time vs batch size for TP=1 and TP=2, every variant a result holds
(``eager``, ``ostinato FULL``, ... with the all-reduce in brackets under TP=2), from the
``decode_tp_*`` JSON results. Usage: python -m benchmarks.plot_tp OUT.png JSON..."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: str, paths: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.loads(Path(p).read_text()) for p in paths]
    shapes = sorted({d["config"]["model"]["hidden_size"] for d in docs})
    fig, axes = plt.subplots(1, len(shapes), figsize=(9 * len(shapes), 4.5), squeeze=False)
    for ax, hidden in zip(axes[0], shapes, strict=True):
        for d in (d for d in docs if d["config"]["model"]["hidden_size"] == hidden):
            tp = d["tensor_parallel_size"]
            variants = dict.fromkeys(r["variant"] for r in d["rows"])
            for variant in variants:
                style = (
                    ":" if variant.startswith("eager") else "--" if "PIECE" not in variant else "-"
                )
                rows = [r for r in d["rows"] if r["variant"] == variant]
                ax.plot(
                    [r["batch"] for r in rows],
                    [r["step_ms"] for r in rows],
                    style,
                    marker="o",
                    label=f"TP={tp} {variant}",
                )
        ax.set_title(f"hidden {hidden} ({d['config']['model']['num_hidden_layers']} layers)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode step, ms")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{docs[0]['device']}, bf16, KV length 512 (all-reduce in brackets)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
