"""An isolated decode step timed before and after one profiler session (CUDA).

    python -m benchmarks.profiler_effect --out OUT/profiler_effect.json [--shape smollm2]
        [--batch-sizes 1,8,128]

The default variant's step at each size, timed as the decode benchmark times it
(``time_step``: device ms and host µs of a step run in isolation; ``pipelined_ms``),
twice before any profiler and once after one ``kernel_census``. With CUDA graphs torch
leaves CUPTI attached after a profiler session, so a benchmark that profiles a size
before timing the next one times the later sizes with that host cost: this measures it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import DEFAULT_SHAPE
from benchmarks.census import kernel_census
from benchmarks.decode import (
    SMOLLM2_CONFIG,
    BenchConfig,
    DecodeSetup,
    model_config,
    pipelined_ms,
    time_step,
    variant_runner,
)
from ostinato.provenance import Provenance

VARIANT = "ostinato FULL_AND_PIECEWISE"
PHASES = ("before any profiler", "again", "after one census")


@dataclass
class Timing:
    phase: str
    batch: int
    step_ms: float
    host_us: float
    pipelined_ms: float


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default=DEFAULT_SHAPE, help="a preset, or smollm2")
    parser.add_argument("--batch-sizes", default="1,8,128")
    args = parser.parse_args()
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    model = model_config(SMOLLM2_CONFIG if args.shape == "smollm2" else args.shape)
    cfg = BenchConfig(model=model, batch_sizes=sizes, variants=(VARIANT,))
    doc = {"benchmark": "profiler_effect", "shape": args.shape}
    doc["provenance"] = asdict(Provenance.collect())
    timings: list[Timing] = []
    with torch.inference_mode():
        setup = DecodeSetup(cfg, torch.device("cuda"))
        runner = variant_runner(setup, VARIANT, True)
        assert runner is not None
        runner.capture()
        steps = {b: setup.decode_step(runner, b) for b in sizes}
        for phase in PHASES:
            if phase == PHASES[-1]:
                kernel_census(steps[sizes[0]])
            for b in sizes:
                ms, host = time_step(steps[b], cfg.warmup, cfg.repeats, True)
                timings.append(Timing(phase, b, ms, host, pipelined_ms(steps[b])))
                t = timings[-1]
                print(f"{args.shape} {phase:20s} B={b:4d} step {ms:.3f} ms, host {host:6.1f} "
                      f"us, pipelined {t.pipelined_ms:.3f} ms", flush=True)  # fmt: skip
    doc["timings"] = [asdict(t) for t in timings]
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
