"""What a released ``graphed`` leaves allocated, and who allocated it:

    python -m benchmarks.graphed_leftover --out OUT/leftover [--model distilbert]

Runs ``graphed(model)`` (the default, staged) over a stream of random batch sizes and
lengths, waits for its upgrade, releases it and collects; then reads the blocks still
allocated that were made after the start, with the Python frames that made them
(``torch.cuda.memory``'s history), and what is left once cuBLAS's per-stream workspaces
are cleared. Writes ``leftover.json`` (and the allocator's snapshot beside it). CUDA only.
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


def live_blocks(snapshot: dict) -> list[Block]:
    """The allocated blocks of ``snapshot`` that carry frames (made while history was
    recorded), largest first."""
    found = []
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and block.get("frames"):
                frames = [
                    f"{f['filename'].split('site-packages/')[-1]}:{f['line']}:{f['name']}"
                    for f in block["frames"]
                ]
                pool = str(segment.get("segment_pool_id", (0, 0)))
                found.append(Block(block["size"] / 2**20, segment.get("stream", 0), pool, frames))
    return sorted(found, key=lambda b: -b.mib)


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
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    fn, fast = system(w, "ostinato default", 32)
    with torch.inference_mode():
        for batch, length in call_stream(w, random.Random(0), args.calls, 32, 0):
            fn(*w.inputs(batch, length))
    fast.wait_for_upgrades()
    fast.release()
    del fn, fast
    left = (clean_slate()[0] - before) / 2**20
    blocks = live_blocks(torch.cuda.memory._snapshot())
    args.out.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(args.out / "leftover_snapshot.pickle"))
    torch._C._cuda_clearCublasWorkspaces()
    cleared = (clean_slate()[0] - before) / 2**20
    print(f"left allocated: {left:.1f} MiB; after clearing cuBLAS's workspaces: {cleared:.1f}")
    for b in blocks[:12]:
        where = f"{b.mib:8.2f} MiB stream {b.stream} pool {b.pool}"
        print(where + "\n    " + "\n    ".join(b.frames[:20]))
    report = {"provenance": asdict(Provenance.collect()), "model": args.model, "left_mib": left,
              "after_cublas_clear_mib": cleared, "blocks": [asdict(b) for b in blocks]}  # fmt: skip
    (args.out / "leftover.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
