"""Where a decode step's time goes on the device's critical path, by kernel role.

With programmatic dependent launch a kernel starts before its predecessor ends, so a
profile's kernel durations overlap and add up to more than the step. Here each kernel is
charged only its *exposed* time: how far it moves the step's end past every kernel
before it (``max(0, end - latest end so far)``). The exposed times and the device's idle
gaps add up to the step's span. Kernels are named by role: the four ``_gemm_kernel``
launches of a layer in order (QKV, O, gate/up, down), attention and its split merge, the
LM head (the one cuBLAS GEMM of a step of at most 16 rows), and the rest. Each
projection's exposed time gives its weight's effective bandwidth, the share of the copy
bandwidth its place on the path streams at.

    python -m benchmarks.critical_path --out OUT/critical_path.json
        [--shape llama-1.5b|smollm2] [--batch-sizes 1,8] [--steps 20]
        [--variant "ostinato FULL"]

The step is ``benchmarks.decode``'s ``--variant`` (by default "ostinato FULL", the
engine's default mode, default kernel options; or one of its kernel variants, such as
"ostinato FULL no-pdl"; random weights, KV length 512), each step profiled in a session
of its own, so a step's first kernel carries no overlap with the step before.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import DEFAULT_SHAPE
from benchmarks.decode import (
    RUNNER_VARIANTS,
    SMOLLM2_CONFIG,
    BenchConfig,
    DecodeSetup,
    copy_bandwidth_gbps,
    model_config,
    variant_rules,
    variant_runner,
)
from ostinato.provenance import Provenance

PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's _gemm_kernel launches, in order


@dataclass(frozen=True)
class Kernel:
    """One device kernel (or copy) of a step: its name and its start and end, µs."""

    name: str
    start: float
    end: float


@dataclass(frozen=True)
class RoleTime:
    """One role's launches per step, their summed exposed and own µs per step, and (for a
    projection or the LM head) its weight bytes per launch and the bandwidth its exposed
    time implies, GB/s."""

    role: str
    per_step: float
    exposed_us: float
    duration_us: float
    weight_bytes: int = 0
    exposed_gbps: float = 0.0


def roles(kernels: Sequence[Kernel], layers: int) -> list[str]:
    """Each kernel's role, in the kernels' order: the ``_gemm_kernel`` launches cycle
    through ``PROJECTIONS`` where there are four per layer, and one more is the LM head
    (a Triton LM head, as the 8 B shape's plans pick); else each is "gemm"."""
    gemms = sum(k.name.startswith("_gemm_kernel") for k in kernels)
    per_layers = len(PROJECTIONS) * layers
    cycle = gemms in (per_layers, per_layers + 1)
    out, g = [], 0
    for k in kernels:
        if k.name.startswith("_gemm_kernel"):
            role = PROJECTIONS[g % len(PROJECTIONS)] if g < per_layers else "lm_head"
            out.append(role if cycle else "gemm")
            g += 1
        elif k.name.startswith("_paged_attention_kernel"):
            out.append("attention")
        elif k.name.startswith("_merge_splits_kernel"):
            out.append("merge")
        elif "nvjet" in k.name or "gemm" in k.name.lower():
            out.append("lm_head")
        elif k.name.startswith(("_chunk_best_kernel", "_row_best_kernel")):
            out.append("argmax")
        else:
            out.append("other")
    return out


def exposed(kernels: Sequence[Kernel]) -> tuple[list[float], float]:
    """Each kernel's exposed µs (kernels ordered by start) and the device's idle µs inside
    the span; together they add up to ``last end - first start``."""
    times, idle = [], 0.0
    latest = kernels[0].start if kernels else 0.0
    for k in kernels:
        idle += max(0.0, k.start - latest)
        times.append(max(0.0, k.end - max(latest, k.start)))
        latest = max(latest, k.end)
    return times, idle


def charge(
    steps: Sequence[Sequence[Kernel]], layers: int, weight_bytes: dict[str, int]
) -> tuple[list[RoleTime], float, float]:
    """Per role, its mean launches, exposed and own µs per step over ``steps`` (each a
    step's kernels ordered by start), with the bandwidth of the roles in
    ``weight_bytes``; and the mean span and idle µs of a step."""
    count: dict[str, int] = {}
    path: dict[str, float] = {}
    own: dict[str, float] = {}
    span = idle = 0.0
    for ks in steps:
        times, gaps = exposed(ks)
        span += ks[-1].end - ks[0].start
        idle += gaps
        for k, role, t in zip(ks, roles(ks, layers), times, strict=True):
            count[role] = count.get(role, 0) + 1
            path[role] = path.get(role, 0.0) + t
            own[role] = own.get(role, 0.0) + (k.end - k.start)
    n = len(steps)
    out = []
    for role in sorted(count, key=lambda r: -path[r]):
        nbytes = weight_bytes.get(role, 0)
        us = path[role] / count[role]  # exposed µs of one launch
        gbps = nbytes / (us * 1e3) if nbytes and us > 0 else 0.0
        out.append(RoleTime(role, count[role] / n, path[role] / n, own[role] / n, nbytes, gbps))
    return out, span / n, idle / n


def profile_step(step: Callable[[], Any]) -> list[Kernel]:
    """The device kernels of one call of ``step`` (kernels inside graph replays included),
    ordered by start: a profiling session of its own, so steps never mix."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.profiler.kineto_results.events()
    kernels = [
        Kernel(e.name(), e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3)
        for e in events
        if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0
    ]
    return sorted(kernels, key=lambda k: k.start)


def projection_bytes(setup: DecodeSetup) -> dict[str, int]:
    """Weight bytes each projection role reads per launch (layer 0's), and the LM head's."""
    layer = setup.model.layers[0]
    weights = {
        "qkv": layer.self_attn.qkv_proj.weight,
        "o": layer.self_attn.o_proj.weight,
        "gate_up": layer.mlp.gate_up_proj.weight,
        "down": layer.mlp.down_proj.weight,
        "lm_head": setup.model.lm_head.weight,
    }
    return {role: w.numel() * w.element_size() for role, w in weights.items()}


@dataclass(frozen=True)
class StepPath:
    """A step of ``batch`` rows: its mean span and idle µs on the device, its roles, and
    its largest idle gap (mean µs) with the kernels on either side (of the first step)."""

    batch: int
    span_us: float
    idle_us: float
    roles: list[RoleTime]
    largest_gap_us: float
    largest_gap_between: tuple[str, str]
    # a middle layer of the first step: (role, start, end) µs after the end of the
    # layer before it, from the layer before's down projection to this layer's
    layer_timeline: list[tuple[str, float, float]]


def layer_timeline(
    kernels: Sequence[Kernel], layers: int, layer: int
) -> list[tuple[str, float, float]]:
    """Layer ``layer``'s kernels (and the down projection before them) as (role, start,
    end), µs after that down projection's end; empty where the roles do not cycle."""
    named = roles(kernels, layers)
    downs = [i for i, r in enumerate(named) if r == "down"]
    if len(downs) != layers or not 0 < layer < layers:
        return []
    first, last = downs[layer - 1], downs[layer]
    t0 = kernels[first].end
    return [(named[i], kernels[i].start - t0, kernels[i].end - t0) for i in range(first, last + 1)]


def largest_gap(kernels: Sequence[Kernel]) -> tuple[float, int]:
    """The longest time no kernel runs inside the span (ordered by start), and the index
    of the kernel that ends it (0 where there is none)."""
    best, where, latest = 0.0, 0, kernels[0].start if kernels else 0.0
    for i, k in enumerate(kernels):
        if k.start - latest > best:
            best, where = k.start - latest, i
        latest = max(latest, k.end)
    return best, where


def measure(setup: DecodeSetup, runner: Any, batch: int, steps: int) -> StepPath:
    """The critical path of ``runner``'s decode step at ``batch`` rows, over ``steps``
    steps profiled one by one after five warm ones."""
    step = setup.decode_step(runner, batch)
    for _ in range(5):
        step()
    profiled = [profile_step(step) for _ in range(steps)]
    layers = setup.config.num_layers
    by_role, span, idle = charge(profiled, layers, projection_bytes(setup))
    gaps = [largest_gap(ks) for ks in profiled]
    first, at = profiled[0], gaps[0][1]  # where, in the first step
    around = (first[max(at - 1, 0)].name[:60], first[at].name[:60])
    timeline = layer_timeline(first, layers, layers // 2)
    return StepPath(batch, span, idle, by_role, sum(g for g, _ in gaps) / steps, around, timeline)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default=DEFAULT_SHAPE, help="a preset, or smollm2")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--steps", type=int, default=20)
    variants = sorted(v for v in RUNNER_VARIANTS if v != "eager")
    parser.add_argument("--variant", default="ostinato FULL", choices=variants)
    args = parser.parse_args()
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    model = model_config(SMOLLM2_CONFIG if args.shape == "smollm2" else args.shape)
    device = torch.device("cuda")
    setup = DecodeSetup(BenchConfig(model=model, batch_sizes=sizes), device)
    bw = copy_bandwidth_gbps(device)
    doc: dict[str, Any] = {"benchmark": "critical_path", "shape": args.shape}
    doc["variant"] = args.variant
    doc |= {"provenance": asdict(Provenance.collect()), "copy_bandwidth_gbps": bw, "rows": []}
    with torch.inference_mode(), variant_rules(args.variant):
        runner = variant_runner(setup, args.variant, cuda=True)
        assert runner is not None  # (a CUDA device, not reduce-overhead)
        runner.capture()
    with torch.inference_mode():
        for b in sizes:
            path = measure(setup, runner, b, args.steps)
            doc["rows"].append(asdict(path))
            gap = f"{path.largest_gap_us:5.1f} us between {path.largest_gap_between}"
            print(f"B={b:3d} span {path.span_us:7.1f} us, idle {path.idle_us:5.1f} us ({gap})")
            for r in path.roles:
                share = f" {r.exposed_gbps / bw:4.0%} of copy" if r.exposed_gbps else ""
                print(f"  {r.role:10s} x{r.per_step:5.1f} exposed {r.exposed_us:7.1f} us "
                      f"own {r.duration_us:7.1f} us{share}", flush=True)  # fmt: skip
            print("  a middle layer, µs after the down projection before it ends: " + ", ".join(
                f"{role} {a:.1f}..{b:.1f}" for role, a, b in path.layer_timeline))  # fmt: skip
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
