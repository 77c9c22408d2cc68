"""Nsight Compute's CSV of a profiled decode step (``benchmarks.profile_step``), summed by
kernel name: launches, µs each (mean), DRAM throughput, warp cycles per issued
instruction, registers and achieved occupancy, as JSON.

    python -m benchmarks.ncu_summary ncu_smollm2_b1.csv.gz --out summary.json
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

_US = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
_MEANS = {
    "dram_pct": "DRAM Throughput",
    "cycles_per_issue": "Warp Cycles Per Issued Instruction",
    "registers": "Registers Per Thread",
    "occupancy_pct": "Achieved Occupancy",
}


@dataclass(frozen=True)
class KernelKind:
    """One kernel name's launches in the profiled window, its metrics averaged."""

    name: str
    launches: int
    us_each: float
    us_total: float
    dram_pct: float
    cycles_per_issue: float
    registers: float
    occupancy_pct: float
    grid: str


def _rows(path: Path) -> list[dict[str, str]]:
    raw = gzip.open(path, "rt") if path.suffix == ".gz" else path.open()
    with raw:
        lines = raw.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))  # after ncu's log
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def _number(value: str) -> float:
    return float(value.replace(",", "")) if value else 0.0


def summarise(path: Path) -> list[KernelKind]:
    """The kinds of kernel in ``path``, the most time first."""
    launches: dict[str, dict[str, float]] = defaultdict(dict)
    names: dict[str, tuple[str, str]] = {}
    for r in _rows(path):
        names[r["ID"]] = (r["Kernel Name"], r["Grid Size"])
        if r["Metric Name"] == "Duration":
            launches[r["ID"]]["us"] = _number(r["Metric Value"]) * _US[r["Metric Unit"]]
        for key, metric in _MEANS.items():
            if r["Metric Name"] == metric:
                launches[r["ID"]][key] = _number(r["Metric Value"])
    kinds: dict[str, list[dict[str, float]]] = defaultdict(list)
    for lid, metrics in launches.items():
        kinds[names[lid][0]].append(metrics)
    out = []
    for name, ms in kinds.items():
        n = len(ms)
        mean = {k: sum(m.get(k, 0.0) for m in ms) / n for k in ("us", *_MEANS)}
        grid = next(g for lid, (nm, g) in names.items() if nm == name)
        total = mean["us"] * n
        fields = {k: mean[k] for k in _MEANS}
        out.append(KernelKind(name[:120], n, mean["us"], total, **fields, grid=grid))
    return sorted(out, key=lambda k: -k.us_total)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    kinds = summarise(args.csv)
    for k in kinds:
        print(f"{k.launches:4d} x {k.us_each:7.2f} us {k.dram_pct:5.1f}% DRAM "
              f"{k.cycles_per_issue:5.1f} cyc/issue  {k.name[:60]}")  # fmt: skip
    doc = {"source": args.csv.name, "total_us": sum(k.us_total for k in kinds)}
    doc["kernels"] = [asdict(k) for k in kinds]
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
