"""Prints the README's decode table (markdown) from a decode benchmark JSON."""

import json
import sys

doc = json.load(open(sys.argv[1]))
rows = doc["rows"]
variants = [
    "eager",
    "ostinato FULL",
    "ostinato PIECEWISE",
    "ostinato FULL_AND_PIECEWISE",
    "torch.compile reduce-overhead",
]
print("| B | floor ms | eager | FULL | PIECEWISE | FULL_AND_PIECEWISE | reduce-overhead |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for b in doc["config"]["batch_sizes"]:
    by = {r["variant"]: r for r in rows if r["batch"] == b}
    fap = by["ostinato FULL_AND_PIECEWISE"]
    cells = [f"{by[v]['step_ms']:.2f}" for v in variants]
    cells[3] = (
        f"**{fap['step_ms']:.2f}** ({fap['x_floor']:.2f}× floor, "
        f"{fap['x_reduce_overhead']:.2f}× r-o)"
    )
    print(f"| {b} | {by['eager']['floor_ms']:.2f} | " + " | ".join(cells) + " |")
for c in doc["costs"]:
    print(
        f"{c['variant']}: compile {c['compile_s']:.1f} s, capture {c['capture_s']:.1f} s, "
        f"pool {c['graph_pool_mib']:.0f} MiB, device {c['graph_device_mib']:.0f} MiB"
    )
print(doc["provenance"])
