"""The planned capture ladder against the default on a skewed load of step sizes.

For each model shape: capture the default FULL ladder up to ``--max-size`` alone in a
new process and take from its capture report the device memory each size took (its pool
growth and the driver's memory for the graph); plan two ladders from a skewed histogram
of step sizes (most steps at 1 to 4 and at 20 to 40 tokens) with ``plan_capture_sizes``:
``equal-memory`` (the default's bytes as budget: least padding) and ``equal-padding``
(the smallest budget whose plan pads no more than the default); capture each alone in a
new process, measure its bytes (the pool's share apart) and time a decode step at every
size of the histogram (the expected step time weights them by the histogram). Then the
cost of checked replays: back-to-back decode steps at batch 1 and 8 with
``verify="sample"`` (one in 1024) against unchecked. Writes JSON (and prints a table). Needs CUDA;
``compare_ladders`` (the planning, from measured bytes) runs anywhere.

    PYTHONPATH=src python -m benchmarks.graph_budget --out benchmarks/results/graph_budget_h200
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.decode import BenchConfig, DecodeSetup, model_config, time_step
from ostinato.batch import BatchDescriptor
from ostinato.capture_planner import device_costs, padded_rows, plan_capture_sizes
from ostinato.capture_report import GraphRecord
from ostinato.config import GraphConfig, default_capture_sizes
from ostinato.modes import GraphMode
from ostinato.pool import release_shared_pool
from ostinato.provenance import Provenance

GRANULE = 1 << 16
"""The planner's unit of bytes here: fine against graphs of megabytes, coarse enough that
its table stays small (a budget of 100 MiB is 1,600 units)."""


@dataclass(frozen=True)
class Ladder:
    """A ladder's sizes, the padded rows it gives the histogram, and the bytes charged
    (planned from measurements) and measured (after its own capture; 0 until then), with
    the expected step time (ms) weighted by the histogram."""

    name: str
    sizes: tuple[int, ...]
    padded_rows: int
    charged_bytes: int
    measured_bytes: int = 0  # device memory its capture took (the driver's view)
    pool_bytes: int = 0  # of which the graph pool's segments
    capture_s: float = 0.0
    step_ms: float = 0.0


def skewed_histogram(steps: int, max_size: int, seed: int = 0) -> dict[int, int]:
    """Half the steps at 1 to 4 tokens, 45% at 20 to 40, the rest up to ``max_size``."""
    rng = random.Random(seed)
    sizes = []
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.5:
            sizes.append(rng.randint(1, 4))
        elif roll < 0.95:
            sizes.append(rng.randint(20, min(40, max_size)))
        else:
            sizes.append(rng.randint(1, max_size))
    return dict(Counter(sizes))


def compare_ladders(
    histogram: dict[int, int], cost: Callable[[int], int], default: tuple[int, ...]
) -> list[Ladder]:
    """The default ladder and the two plans (see the module), charged ``cost(size)``
    bytes per graph (``device_costs`` of the default ladder's capture)."""
    max_size = max(default)
    total = sum(cost(n) for n in default)
    ladders = [Ladder("default", default, padded_rows(histogram, default), total)]
    same_memory = plan_capture_sizes(histogram, max_size, total, cost, granule=GRANULE)
    ladders.append(
        Ladder("equal-memory", same_memory.sizes, same_memory.padded_rows, same_memory.bytes)
    )
    low, high = cost(max_size), total  # the smallest budget padding no more than default
    while low < high:
        mid = (low + high) // 2
        plan = plan_capture_sizes(histogram, max_size, mid, cost, granule=GRANULE)
        if plan.padded_rows <= ladders[0].padded_rows:
            high = mid
        else:
            low = mid + 1
    plan = plan_capture_sizes(histogram, max_size, low, cost, granule=GRANULE)
    ladders.append(Ladder("equal-padding", plan.sizes, plan.padded_rows, plan.bytes))
    return ladders


def _runner(
    setup: DecodeSetup, sizes: tuple[int, ...], verify: str = "off", every: int = 1024
) -> Any:
    config = GraphConfig(
        mode=GraphMode.FULL, capture_sizes=sizes, verify=verify, verify_every=every
    )
    return setup.runner(GraphMode.FULL, None, graphs=config)


def _fresh_pool() -> None:
    """The next runner captures into a pool of its own."""
    release_shared_pool()
    gc.collect()
    torch.cuda.empty_cache()


@dataclass(frozen=True)
class Captured:
    """One ladder captured alone in a fresh process: per size, the device memory its
    capture took (its pool growth and the driver's memory for the graph itself) and the
    pool's share; capture seconds; ms of a decode step at each size of the histogram."""

    device_bytes: dict[int, int]
    pool_bytes: dict[int, int]
    capture_s: float
    step_ms: dict[int, float]

    def costs(self) -> Callable[[int], int]:
        """What the planner charges a graph of each size (``device_costs``)."""
        records = [
            GraphRecord(BatchDescriptor(n), GraphMode.FULL, self.pool_bytes[n], device, 0.0)
            for n, device in self.device_bytes.items()
        ]
        return device_costs(records)


def capture_alone(name: str, sizes: tuple[int, ...], histogram: dict[int, int]) -> Captured:
    setup = DecodeSetup(_bench_config(name, max(sizes)), torch.device("cuda"))
    runner = _runner(setup, sizes)
    with torch.inference_mode():
        report = runner.capture()
        times = {n: time_step(setup.decode_step(runner, n), 3, 10, True)[0] for n in histogram}
    return Captured(
        {r.descriptor.num_tokens: r.device_bytes for r in report.records},
        {r.descriptor.num_tokens: r.pool_bytes for r in report.records},
        report.seconds,
        times,
    )


def _in_fresh_process(name: str, sizes: tuple[int, ...], histogram: dict[int, int]) -> Captured:
    """``capture_alone`` in a new process: nothing cached, no pool, no graph before it."""
    job = json.dumps({"name": name, "sizes": sizes, "histogram": histogram})
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.graph_budget", "--one", job],
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    ints = lambda d: {int(k): v for k, v in d.items()}  # noqa: E731 - JSON keys are str
    return Captured(
        ints(got["device_bytes"]), ints(got["pool_bytes"]), got["capture_s"], ints(got["step_ms"])
    )


def _measured(ladder: Ladder, got: Captured, histogram: dict[int, int]) -> Ladder:
    steps = sum(histogram.values())
    expected = sum(got.step_ms[n] * c for n, c in histogram.items()) / steps
    return replace(
        ladder,
        measured_bytes=sum(got.device_bytes.values()),
        pool_bytes=sum(got.pool_bytes.values()),
        capture_s=got.capture_s,
        step_ms=expected,
    )


@dataclass(frozen=True)
class SamplingCost:
    """Back-to-back decode steps of one batch size, unchecked and with one replay in
    ``every`` re-run eagerly (``verify="sample"``), in alternating passes: the best ms
    per step of each, the checks the sampled passes made, and the cost as a fraction."""

    batch: int
    steps: int
    every: int
    off_ms: float
    sample_ms: float
    checked_replays: int

    @property
    def cost(self) -> float:
        return self.sample_ms / self.off_ms - 1


def sampling_cost(
    setup: DecodeSetup, sizes: tuple[int, ...], batch: int, steps: int, every: int
) -> SamplingCost:
    best: dict[str, float] = {}
    checked = 0
    for verify in ("off", "sample", "off", "sample"):  # alternating, against drift
        _fresh_pool()
        runner = _runner(setup, sizes, verify, every)
        with torch.inference_mode():
            runner.capture()
            step = setup.decode_step(runner, batch)
            for _ in range(10):
                step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3 / steps
        best[verify] = min(ms, best.get(verify, ms))
        checked += runner.graphs.manager.stats().checked_replays
        runner.release()
    return SamplingCost(batch, steps, every, best["off"], best["sample"], checked)


def _bench_config(name: str, max_size: int) -> BenchConfig:
    """A preset shape by name, or an HF config file (``benchmarks/configs/*.json``)."""
    return BenchConfig(model=model_config(name), batch_sizes=(max_size,), kv_len=512)


def run_shape(name: str, max_size: int, steps: int, sample_steps: int) -> dict:
    default = tuple(default_capture_sizes(max_size))
    histogram = skewed_histogram(steps, max_size)
    first = _in_fresh_process(name, default, histogram)
    planned = compare_ladders(histogram, first.costs(), default)
    ladders = [_measured(planned[0], first, histogram)]
    for ladder in planned[1:]:
        ladders.append(
            _measured(ladder, _in_fresh_process(name, ladder.sizes, histogram), histogram)
        )
    setup = DecodeSetup(_bench_config(name, max_size), torch.device("cuda"))
    costs = [sampling_cost(setup, default, b, sample_steps, 1024) for b in (1, 8)]
    return {
        "shape": name,
        "max_size": max_size,
        "histogram": histogram,
        "measured_default": first.device_bytes,
        "pool_default": first.pool_bytes,
        "ladders": [asdict(x) for x in ladders],
        "sampling": [asdict(c) | {"cost": c.cost} for c in costs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        default="benchmarks/configs/smollm2_135m.json,llama-1.5b",
        help="preset shapes or HF config files (random weights)",
    )
    parser.add_argument("--max-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument(
        "--sample-steps", type=int, default=4096, help="decode steps per sampling-cost pass"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: capture_alone
    args = parser.parse_args()
    if args.one:
        job = json.loads(args.one)
        histogram = {int(k): v for k, v in job["histogram"].items()}
        print(json.dumps(asdict(capture_alone(job["name"], tuple(job["sizes"]), histogram))))
        return
    if args.out is None:
        parser.error("the following arguments are required: --out")
    runs = [
        run_shape(s, args.max_size, args.steps, args.sample_steps) for s in args.shapes.split(",")
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"provenance": asdict(Provenance.collect()), "runs": runs}
    (args.out / "graph_budget.json").write_text(json.dumps(doc, indent=1))
    for run in runs:
        print(run["shape"])
        for x in run["ladders"]:
            print(
                f"  {x['name']:14} {len(x['sizes']):3} sizes  padded {x['padded_rows']:7}  "
                f"charged {x['charged_bytes'] / 2**20:6.1f} MiB  measured "
                f"{x['measured_bytes'] / 2**20:6.1f} MiB (pool {x['pool_bytes'] / 2**20:5.1f})  "
                f"capture {x['capture_s']:5.2f} s  step {x['step_ms']:.3f} ms"
            )
        for c in run["sampling"]:
            print(
                f"  sampling 1/{c['every']} at B={c['batch']}: {c['off_ms']:.4f} -> "
                f"{c['sample_ms']:.4f} ms/step ({c['cost']:+.2%}), {c['checked_replays']} checks"
            )


if __name__ == "__main__":
    main()
