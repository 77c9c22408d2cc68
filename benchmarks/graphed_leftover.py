"""What a released ``graphed`` leaves allocated, what was live at its peak, and who
allocated them:

    python -m benchmarks.graphed_leftover --out OUT/leftover [--model distilbert]

Runs ``graphed(model)`` (the default, staged) over a stream of random batch sizes and
lengths, waits for its upgrade, releases it and collects; then reads the blocks still
allocated that were made after the start, with the Python frames that made them
(``torch.cuda.memory``'s history), and what is left once cuBLAS's per-stream workspaces
are cleared; and, replaying the history's allocations and frees, the blocks live at the
moment the most was allocated (the peak ``graphed_models`` reports). Writes
``leftover.json`` (and the allocator's snapshot beside it). CUDA only.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.graphed_models import Where, call_stream, clean_slate, system, workloads
from ostinato.provenance import Provenance


@dataclass(frozen=True)
class Block:
    mib: float
    stream: int
    pool: str  # the segment's pool: (0, 0) is the global one, any other a graph pool
    frames: list[str]  # innermost first


def _frames(entry: dict) -> list[str]:
    return [
        f"{f['filename'].split('site-packages/')[-1]}:{f['line']}:{f['name']}"
        for f in entry.get("frames", [])
    ]


def live_blocks(snapshot: dict) -> list[Block]:
    """The allocated blocks of ``snapshot`` that carry frames (made while history was
    recorded), largest first."""
    found = []
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and block.get("frames"):
                frames = _frames(block)
                pool = str(segment.get("segment_pool_id", (0, 0)))
                found.append(Block(block["size"] / 2**20, segment.get("stream", 0), pool, frames))
    return sorted(found, key=lambda b: -b.mib)


def peak_blocks(snapshot: dict, device: int = 0) -> tuple[float, list[Block]]:
    """The most allocated at once by blocks made while history was recorded (MiB), and
    those blocks, largest first: the device's trace of allocations and frees replayed
    (a block counts from its allocation until its free is requested, as the allocator's
    allocated statistics count it; frees of blocks made before the history are skipped).
    Blocks carry no pool here (a trace entry does not name one)."""
    trace = snapshot["device_traces"][device]
    live: dict[int, int] = {}  # address: the entry's index
    total = peak = at = 0
    for i, entry in enumerate(trace):
        if entry["action"] == "alloc":
            live[entry["addr"]] = i
            total += entry["size"]
            if total > peak:
                peak, at = total, i
        elif entry["action"] == "free_requested" and entry["addr"] in live:
            total -= trace[live.pop(entry["addr"])]["size"]
    live.clear()
    for i, entry in enumerate(trace[: at + 1]):
        if entry["action"] == "alloc":
            live[entry["addr"]] = i
        elif entry["action"] == "free_requested":
            live.pop(entry["addr"], None)
    blocks = [
        Block(trace[i]["size"] / 2**20, trace[i].get("stream", 0), "?", _frames(trace[i]))
        for i in live.values()
    ]
    return peak / 2**20, sorted(blocks, key=lambda b: -b.mib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="distilbert")
    parser.add_argument("--calls", type=int, default=24)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graphed_leftover: needs CUDA (the CPU has no graphs to leave)")
    (w,) = workloads([args.model], Where("cuda", torch.bfloat16, False))
    before = clean_slate()[0]
    torch.cuda.memory._record_memory_history(max_entries=5_000_000, stacks="python")
    fn, fast = system(w, "ostinato default", 32)
    with torch.inference_mode():
        for batch, length in call_stream(w, random.Random(0), args.calls, 32, 0):
            fn(*w.inputs(batch, length))
    fast.wait_for_upgrades()
    fast.release()
    del fn, fast
    left = (clean_slate()[0] - before) / 2**20
    snapshot = torch.cuda.memory._snapshot()
    blocks = live_blocks(snapshot)
    peak, at_peak = peak_blocks(snapshot)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(args.out / "leftover_snapshot.pickle"))
    torch._C._cuda_clearCublasWorkspaces()
    cleared = (clean_slate()[0] - before) / 2**20
    print(f"left allocated: {left:.1f} MiB; after clearing cuBLAS's workspaces: {cleared:.1f}")
    for b in blocks[:12]:
        where = f"{b.mib:8.2f} MiB stream {b.stream} pool {b.pool}"
        print(where + "\n    " + "\n    ".join(b.frames[:20]))
    print(f"peak: {peak:.1f} MiB allocated at once since the start; its blocks, largest first:")
    for b in at_peak[:16]:
        print(f"{b.mib:8.2f} MiB stream {b.stream}\n    " + "\n    ".join(b.frames[:24]))
    report = {"provenance": asdict(Provenance.collect()), "model": args.model, "left_mib": left,
              "after_cublas_clear_mib": cleared, "blocks": [asdict(b) for b in blocks],
              "peak_mib": peak, "at_peak": [asdict(b) for b in at_peak]}  # fmt: skip
    (args.out / "leftover.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
