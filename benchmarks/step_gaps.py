"""Where an engine decode step's device time goes, per sampling parameter set: a
``torch.profiler`` trace of ``LLM.generate`` on a preset shape (random weights, every
request of the batch with one ``sampling_cost`` variant), read back into the step's
device timeline.

    python -m benchmarks.step_gaps --out OUT/gaps.json [--model llama-1.5b]
        [--batch 64] [--variants greedy,all] [--new-tokens 40]

Per variant: the step time (``sampling_cost.step_ms``, median of three), the decode
region's busy share and its idle gaps over 3 µs by the host call that queued the work
after them (and whether that call came after the device went idle: the host late), the
device time per kernel, and one median step's operations in order with the gap before
each (a step begins at the embedding kernel), so an extra copy or launch reads at once.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.ready import ready
from benchmarks.sampling_cost import VARIANTS, step_ms

STEP_START = "_embed_rope_kernel"  # (the first kernel of every decode step)
GAP_US = 3.0


@dataclass(frozen=True)
class Op:
    """One device operation of a step: its name, microseconds idle before it, its own."""

    name: str
    gap_us: float
    us: float


@dataclass(frozen=True)
class VariantGaps:
    """One sampling variant's decode timeline (``step_gaps``' module docstring)."""

    variant: str
    step_ms: float
    steps: int
    busy_share: float
    gaps_us_per_step: float
    host_late_us_per_step: float
    gaps_by_launch: dict[str, float]
    kernels_us_per_step: dict[str, float]
    median_step: list[Op]
    host_us_per_step: dict[str, float]


def _device_events(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cats = ("kernel", "gpu_memcpy", "gpu_memset")
    gpu = [e for e in trace if e.get("ph") == "X" and e.get("cat") in cats]
    return sorted(gpu, key=lambda e: e["ts"])


def _steps(gpu: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The device events cut at each step's first kernel (the first cut dropped: the
    prefill and what came before it; the last: the end of the generate)."""
    cuts = [i for i, e in enumerate(gpu) if e["name"].startswith(STEP_START)]
    return [gpu[a:b] for a, b in zip(cuts[1:], cuts[2:], strict=False)]


def analyse(trace: list[dict[str, Any]], variant: str, ms: float) -> VariantGaps:
    """``VariantGaps`` of one generate's trace: the decode steps are the runs of device
    events between two embedding kernels, the first (prefill) and last dropped."""
    gpu = _device_events(trace)
    launches = {
        e["args"].get("correlation"): e
        for e in trace
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
    }
    steps = _steps(gpu)
    if len(steps) < 4:
        raise RuntimeError(f"{variant}: {len(steps)} decode steps found in the trace")
    steps = steps[len(steps) // 4 :]  # (the first steps warm caches)
    busy = span = gaps = late = 0.0
    by_launch: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    spans = []
    for events in steps:
        end = events[0]["ts"]
        for e in events:
            gap = e["ts"] - end
            if gap > GAP_US:
                gaps += gap
                launch = launches.get(e["args"].get("correlation"))
                name = launch["name"] if launch else "(no launch)"
                host_late = launch is not None and launch["ts"] > end
                late += gap if host_late else 0.0
                by_launch[f"{name}{' (host late)' if host_late else ''}"] += gap
            busy += e["dur"]
            kernels[e["name"][:80]] += e["dur"]
            end = max(end, e["ts"] + e["dur"])
        spans.append(end - events[0]["ts"])
        span += end - events[0]["ts"]
    n = len(steps)
    median = steps[spans.index(statistics.median_low(spans))]
    ops, end = [], median[0]["ts"]
    for e in median:
        ops.append(Op(e["name"][:80], round(max(0.0, e["ts"] - end), 2), round(e["dur"], 2)))
        end = max(end, e["ts"] + e["dur"])
    top = {k: round(v / n, 2) for k, v in kernels.most_common(40)}
    return VariantGaps(
        variant,
        round(ms, 4),
        n,
        round(busy / span, 4),
        round(gaps / n, 2),
        round(late / n, 2),
        {k: round(v / n, 2) for k, v in by_launch.most_common(12)},
        top,
        ops,
        {},
    )


def host_profile(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, float]:
    """Microseconds a step of each function's own time (cProfile's, the calls it makes
    excluded) over one generate of ``params``, the 30 largest: where the host's time goes
    when the device waits for it."""
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params)
    profiler.disable()
    own: Counter[str] = Counter()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (.., .., own time, ..)
    for (path, _line, fn), entry in stats.items():  # type: ignore[attr-defined]
        own[f"{path.split('ostinato/')[-1]}:{fn}"] += entry[2]
    return {k: round(v / params.max_tokens * 1e6, 2) for k, v in own.most_common(30)}


def profile_variant(llm: Any, prompts: list[list[int]], name: str, new: int) -> VariantGaps:
    """``name``'s step time (median of three), one traced generate, analysed, and one
    under cProfile (``host_profile``)."""
    from torch.profiler import ProfilerActivity, profile

    from ostinato.engine import SamplingParams

    params = replace(SamplingParams(max_tokens=new, ignore_eos=True), **VARIANTS[name])
    step_ms(llm, prompts, params, 2, 4)
    ms = statistics.median(step_ms(llm, prompts, params, 16, 80) for _ in range(3))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())["traceEvents"]
    return replace(analyse(trace, name, ms), host_us_per_step=host_profile(llm, prompts, params))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama-1.5b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--variants", default="greedy,all")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=128)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_gaps: needs a CUDA device (it reads the device's timeline)")
    from ostinato.engine import LLM

    llm = LLM(args.model, dtype=torch.bfloat16, max_num_seqs=args.batch, max_model_len=512)
    ready(llm)
    prompts = [list(range(100, 100 + args.prompt_len))] * args.batch
    results = []
    try:
        for name in args.variants.split(","):
            result = profile_variant(llm, prompts, name, args.new_tokens)
            results.append(result)
            print(
                f"{name}: step {result.step_ms:.3f} ms, busy {result.busy_share:.3f}, gaps "
                f"{result.gaps_us_per_step:.1f} us a step ({result.host_late_us_per_step:.1f} "
                "host late)",
                flush=True,
            )
    finally:
        llm.close()
    from ostinato.provenance import Provenance

    variants = [asdict(r) for r in results]
    out = {"provenance": asdict(Provenance.collect()), "args": vars(args), "variants": variants}
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
