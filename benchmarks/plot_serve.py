"""Plots server throughput over offline ``generate`` against the number of concurrent
clients, per model and phase, from ``serve_load`` results (bars: the whole phase;
dots: its steady window), and, where a result has open-loop phases, TTFT and TPOT
against the request rate below. Usage: python -m benchmarks.plot_serve OUT.png JSON..."""

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
    rated = any(r.get("rate") is not None for d in docs for r in d["rows"])
    fig, axes = plt.subplots(
        2 if rated else 1, len(docs), figsize=(6 * len(docs), 8 if rated else 4), squeeze=False
    )
    for ax, doc in zip(axes[0], docs, strict=True):
        clients = sorted({r["clients"] for r in doc["rows"] if r.get("rate") is None})
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
    if rated:
        for ax, doc in zip(axes[1], docs, strict=True):
            _latency(ax, doc)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _latency(ax, doc: dict) -> None:
    """TTFT (p50, p99) and TPOT (p50) against the open-loop request rate."""
    rows = sorted((r for r in doc["rows"] if r.get("rate") is not None), key=lambda r: r["rate"])
    labels = [f"{r['rate']:g}" for r in rows]
    for key, q, style in (
        ("ttft_ms", "p50", "o-"),
        ("ttft_ms", "p99", "o--"),
        ("tpot_ms", "p50", "s-"),
    ):
        ax.plot(labels, [r["server"][key][q] for r in rows], style, label=f"{key[:4].upper()} {q}")
    ax.set_xlabel("requests per second (open loop)")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend(fontsize=7)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
