"""Host time per decode step: ostinato (dispatch + copy-in + replay) vs a bare graph.replay().

The model is deliberately tiny so that device time stays below host time; each timed
burst is short enough that the launch queue never fills, so the numbers are host time.

    PYTHONPATH=src python -m benchmarks.host_overhead --out benchmarks/results/FILE.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ostinato import BatchDescriptor, GraphConfig, GraphMode, GraphRuntime, build_graph_runtime
from ostinato.provenance import Provenance

TARGET_US = 15.0


@dataclass
class HostOverhead:
    batch_sizes: list[int]
    bare_replay_us: float
    dispatch_us: float
    copy_in_us: float
    copy_in_prebuilt_views_us: float
    plan_and_run_us: float
    step_us: float
    step_p10_us: float
    step_p90_us: float
    step_kept_views_us: float
    overhead_us: float
    overhead_kept_views_us: float
    target_us: float
    bursts: int
    burst_len: int


def _burst_us(fn, bursts: int, burst_len: int) -> float:
    """Median over bursts of host microseconds per call; the device drains between bursts."""
    return statistics.median(_burst_samples(fn, bursts, burst_len))


def _burst_samples(fn, bursts: int, burst_len: int) -> list[float]:
    samples = []
    for _ in range(bursts):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(burst_len):
            fn()
        samples.append((time.perf_counter() - t0) / burst_len * 1e6)
    torch.cuda.synchronize()
    return samples


@dataclass
class _Rig:
    """The tiny model's graphs, its persistent input buffer and pinned host ids."""

    graphs: GraphRuntime
    input_ids: torch.Tensor
    host_ids: torch.Tensor


def _rig(sizes: list[int]) -> _Rig:
    device = torch.device("cuda")
    # A model small enough that device time stays below host time: an embedding and one
    # MLP block over a persistent input buffer, as the demo's runner keeps it.
    mlp = [torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 64)]
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), *mlp, torch.nn.RMSNorm(64))
    model = model.to(device, torch.bfloat16).eval()
    config = GraphConfig(mode=GraphMode.FULL)
    input_ids = torch.zeros(config.largest_size, dtype=torch.long, device=device)

    def forward(d: BatchDescriptor) -> torch.Tensor:
        return model(input_ids[: d.num_tokens])

    graphs = build_graph_runtime(forward, config, progress=False)
    graphs.manager.capture()
    # Step inputs arrive on the host, as token ids from a scheduler, in pinned memory.
    host_ids = torch.randint(0, 1000, (max(sizes),), dtype=torch.long).pin_memory()
    return _Rig(graphs, input_ids, host_ids)


@dataclass(frozen=True)
class _Calls:
    """The timed calls, each taking the next of the sizes in turn."""

    dispatch_only: Callable[[], None]
    step: Callable[[], None]
    copy_only: Callable[[], None]
    copy_prebuilt_views: Callable[[], None]
    step_with_kept_views: Callable[[], None]
    plan_and_run: Callable[[], None]


def _calls(rig: _Rig, sizes: list[int]) -> _Calls:
    """The timed calls over ``rig``, each taking the next of ``sizes`` in turn."""
    manager, dispatch = rig.graphs.manager, rig.graphs.dispatch
    dst, src = rig.input_ids, rig.host_ids
    # The same copy with both slices built once per size, as a runner can keep them.
    dst_views = [dst[:n] for n in range(max(sizes) + 1)]
    src_views = [src[:n] for n in range(max(sizes) + 1)]
    turn = itertools.cycle(sizes)

    def dispatch_only() -> None:
        dispatch(next(turn))

    def step() -> None:
        n = next(turn)
        plan = dispatch(n)
        dst[:n].copy_(src[:n], non_blocking=True)
        manager.run(plan, n)

    def copy_only() -> None:
        n = next(turn)
        dst[:n].copy_(src[:n], non_blocking=True)

    def copy_prebuilt_views() -> None:
        n = next(turn)
        dst_views[n].copy_(src_views[n], non_blocking=True)

    def step_with_kept_views() -> None:
        n = next(turn)
        plan = dispatch(n)
        dst_views[n].copy_(src_views[n], non_blocking=True)
        manager.run(plan, n)

    def plan_and_run() -> None:
        n = next(turn)
        manager.run(dispatch(n), n)

    return _Calls(
        dispatch_only, step, copy_only, copy_prebuilt_views, step_with_kept_views, plan_and_run
    )


@torch.inference_mode()
def measure(bursts: int = 200, burst_len: int = 100) -> HostOverhead:
    sizes = [1, 3, 8, 13, 32, 100]
    rig = _rig(sizes)
    calls = _calls(rig, sizes)
    manager = rig.graphs.manager
    bare = _burst_us(manager.graph(rig.graphs.dispatch(8).descriptor).replay, bursts, burst_len)
    step_samples = sorted(_burst_samples(calls.step, bursts, burst_len))
    full_step = statistics.median(step_samples)
    kept_views_step = _burst_us(calls.step_with_kept_views, bursts, burst_len)
    return HostOverhead(
        batch_sizes=sizes,
        bare_replay_us=bare,
        dispatch_us=_burst_us(calls.dispatch_only, bursts, burst_len),
        copy_in_us=_burst_us(calls.copy_only, bursts, burst_len),
        copy_in_prebuilt_views_us=_burst_us(calls.copy_prebuilt_views, bursts, burst_len),
        plan_and_run_us=_burst_us(calls.plan_and_run, bursts, burst_len),
        step_us=full_step,
        step_p10_us=step_samples[len(step_samples) // 10],
        step_p90_us=step_samples[len(step_samples) * 9 // 10],
        step_kept_views_us=kept_views_step,
        overhead_us=full_step - bare,
        overhead_kept_views_us=kept_views_step - bare,
        target_us=TARGET_US,
        bursts=bursts,
        burst_len=burst_len,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args()
    result = measure()
    print(f"bare graph.replay(): {result.bare_replay_us:6.2f} us")
    print(f"dispatch only:       {result.dispatch_us:6.2f} us")
    print(f"copy-in only:        {result.copy_in_us:6.2f} us  (pinned host ids -> device buffer)")
    print(f"copy-in, views kept: {result.copy_in_prebuilt_views_us:6.2f} us")
    print(f"plan + replay:       {result.plan_and_run_us:6.2f} us")
    print(
        f"ostinato step:       {result.step_us:6.2f} us  (dispatch + copy-in + replay + slice;"
        f" bursts p10 {result.step_p10_us:.2f}, p90 {result.step_p90_us:.2f})"
    )
    print(f"step, views kept:    {result.step_kept_views_us:6.2f} us")
    print(f"overhead vs bare:    {result.overhead_us:6.2f} us; step target <= {TARGET_US} us")
    if args.out:
        doc = {
            "benchmark": "host_overhead",
            "provenance": asdict(Provenance.collect()),
            "result": asdict(result),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
