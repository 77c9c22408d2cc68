"""Bench output: the table, the JSON document, and the plot."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.decode import BenchResult
from ostinato.provenance import Provenance


def table(result: BenchResult) -> str:
    """Rows per batch size: step ms, host µs, ratio to the floor and to reduce-overhead,
    ms per step run back to back (CUDA: the replay without host jitter),
    and, where the run profiled them, kernels per step and per layer and their busy µs."""
    census = any(r.kernels is not None for r in result.rows)
    lines = [
        f"device: {result.device}; copy bandwidth {result.copy_bandwidth_gbps:.0f} GB/s; "
        f"KV length {result.config.kv_len}; {result.config.dtype}",
        f"{'variant':32s} {'B':>4s} {'step ms':>9s} {'host us':>9s} {'floor ms':>9s} "
        f"{'x floor':>8s} {'x r-o':>7s} {'piped ms':>8s}"
        + (f" {'kernels':>8s} {'/layer':>7s} {'in layer':>8s} {'busy us':>9s}" if census else ""),
    ]
    for b in result.config.batch_sizes:
        for r in (r for r in result.rows if r.batch == b):
            ro = f"{r.x_reduce_overhead:7.2f}" if r.x_reduce_overhead is not None else "      -"
            ro += f" {r.pipelined_ms:8.3f}" if r.pipelined_ms is not None else f" {'-':>8s}"
            kernels = ""
            if census:
                kernels = (
                    f" {'-':>8s} {'-':>7s} {'-':>8s} {'-':>9s}"
                    if r.kernels is None
                    else f" {r.kernels:8.0f} {r.kernels_per_layer:7.1f} "
                    f"{'-' if r.kernels_in_layer is None else r.kernels_in_layer:>8} "
                    f"{r.busy_us:9.1f}"
                )
            lines.append(
                f"{r.variant:32s} {b:4d} {r.step_ms:9.3f} {r.host_us:9.1f} "
                f"{r.floor_ms:9.3f} {r.x_floor:8.2f} {ro}{kernels}"
            )
    lines.append("")
    lines.append(
        f"{'variant':32s} {'compile s':>9s} {'capture s':>9s} {'start-up s':>10s} "
        f"{'pool MiB':>9s} {'graphs':>7s}"
    )
    for c in result.costs:
        lines.append(
            f"{c.variant:32s} {c.compile_s:9.2f} {c.capture_s:9.2f} {c.startup_s:10.2f} "
            f"{c.graph_pool_mib:9.1f} {c.num_graphs:7d}" + (f"  ({c.note})" if c.note else "")
        )
    for key, kernels in result.profile.items():
        lines.append(f"top kernels, {key}: " + "; ".join(f"{k} {p}%" for k, p in kernels))
    layers = result.config.model["num_hidden_layers"]
    for key, names in result.kernels_by_name.items():
        if key.endswith(" B=1"):
            lines.append(f"kernels per step by name, {key} (/layer: over {layers} layers):")
            lines += [
                f"  {k.per_step:6.1f} {k.per_step / layers:5.2f}/layer {k.us_per_step:8.1f} us  "
                f"{k.name[:90]}"
                for k in names
            ]
    lines += result.notes
    if result.all_reduce_us:
        us = result.all_reduce_us
        lines.append("all-reduce per call in a captured graph (us), slowest rank:")
        lines.append(f"{'bytes':>10s} " + " ".join(f"{k:>9s}" for k in us if k != "sizes"))
        for i, size in enumerate(us["sizes"]):
            row = " ".join(f"{v[i]:9.1f}" for k, v in us.items() if k != "sizes")
            lines.append(f"{int(size):10d} {row}")
    return "\n".join(lines)


def document(result: BenchResult) -> dict[str, Any]:
    """The JSON document: provenance, configuration and every number."""
    doc = asdict(result)
    doc["costs"] = [{**asdict(c), "startup_s": c.startup_s} for c in result.costs]
    return {"benchmark": "decode_step", "provenance": asdict(Provenance.collect()), **doc}


def write_json(result: BenchResult, path: Path) -> None:
    """Writes ``document(result)`` to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document(result), indent=2, allow_nan=True) + "\n")


def plot(doc: dict[str, Any], path: Path) -> None:
    """Step time vs batch size per variant, with the floor; needs matplotlib. Where the
    rows have it, the time of steps run back to back (free of host jitter), else the
    isolated step time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            "--plot needs matplotlib (pip install matplotlib); the JSON can be "
            "plotted later with `python -m benchmarks --plot-from FILE --plot OUT`"
        ) from exc
    rows = doc["rows"]
    batches = sorted({r["batch"] for r in rows})
    piped = any(r.get("pipelined_ms") is not None for r in rows)

    def ms(r: dict[str, Any]) -> float:
        return r["pipelined_ms"] if piped and r.get("pipelined_ms") is not None else r["step_ms"]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = sorted((r["batch"], ms(r)) for r in rows if r["variant"] == variant)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
    floor = {r["batch"]: r["floor_ms"] for r in rows}
    if not any(math.isnan(v) for v in floor.values()):
        ax.plot(batches, [floor[b] for b in batches], "k--", label="floor (bytes / copy bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel(f"batch size (decode, KV length {doc['config']['kv_len']})")
    ax.set_ylabel(
        "step time (ms; steps back to back where measured)" if piped else "step time (ms)"
    )
    prov = doc.get("provenance", {})
    ax.set_title(
        f"decode step, {prov.get('device', doc.get('device'))}, torch {prov.get('torch', '')}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
