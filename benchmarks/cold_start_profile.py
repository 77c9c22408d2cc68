"""Where a cold start-up goes: ``LLM`` of the 1.5 B shape in FULL_AND_PIECEWISE (the e2e
benchmark's settings) with empty Inductor and Triton caches, optionally under cProfile.

    python -m benchmarks.cold_start_profile --out OUT/cold.json [--profile OUT/cold.prof.txt]
        [--compiler eager] [--max-capture-size N] [--phases] [--compile-ahead]
        [--num-warmups N]

Writes the start-up split (weights, compile, capture, total) as JSON; with ``--profile``
also the functions with the most cumulative and own time (cProfile slows Python-heavy
phases such as Dynamo's tracing, so read its shares, not its seconds). ``--phases``
times the start-up's main calls (inclusive seconds and calls each, nested calls counted
in both) and every Triton compilation in this process, by kernel, at almost no cost.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from wall_timers import WallTimers


def _triton_census(cache: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for meta in cache.rglob("*.json"):
        if meta.name.startswith("__grp__"):
            continue
        try:
            name = json.loads(meta.read_text()).get("name")
        except (OSError, ValueError):
            continue
        if name:
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


class Phases:
    """Wall seconds and calls of wrapped functions (inclusive: nested calls count in both)."""

    def __init__(self) -> None:
        self.timers = WallTimers()
        self.wrap = self.timers.wrap
        self.triton: list[tuple[str, float]] = []

    def wrap_triton(self) -> None:
        import triton.compiler
        import triton.compiler.compiler

        fn = triton.compiler.compiler.compile

        def compile(src, *args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(src, *args, **kwargs)
            finally:
                name = getattr(getattr(src, "fn", None), "__name__", str(src)[:40])
                self.triton.append((name, time.perf_counter() - start))

        triton.compiler.compiler.compile = compile
        triton.compiler.compile = compile

    def install(self) -> None:
        import torch._inductor.compile_fx

        from ostinato.engine.api import llm
        from ostinato.graph import GraphWrapper
        from ostinato.manager import GraphManager
        from ostinato.piecewise import PiecewiseBackend

        self.wrap_triton()
        self.wrap(torch.cuda, "init", "torch.cuda.init")
        self.wrap(llm, "open_model", "open_model")
        self.wrap(llm, "init_parallel", "init_parallel")
        self.wrap(llm.LLM, "_plan_memory", "LLM._plan_memory")
        self.wrap(llm.LLM, "_build", "LLM._build")
        self.wrap(llm.DecoderModel, "reset_parameters", "DecoderModel.reset_parameters")
        self.wrap(llm.KVCache, "__init__", "KVCache()")
        self.wrap(llm.ModelRunner, "__init__", "ModelRunner()")
        self.wrap(llm.ModelRunner, "compile", "ModelRunner.compile")
        self.wrap(llm.ModelRunner, "capture", "ModelRunner.capture")
        self.wrap(PiecewiseBackend, "__call__", "PiecewiseBackend (split + pieces)")
        self.wrap(torch._inductor.compile_fx, "compile_fx", "inductor compile_fx")
        self.wrap(GraphManager, "capture", "GraphManager.capture")
        self.wrap(GraphWrapper, "__call__", "GraphWrapper calls (capture + warm-up runs)")
        self.wrap(torch.cuda.CUDAGraph, "capture_end", "CUDAGraph.capture_end")
        self.wrap(torch.cuda.CUDAGraph, "capture_begin", "CUDAGraph.capture_begin")

    def report(self) -> dict[str, object]:
        by_kernel: dict[str, float] = {}
        for name, seconds in self.triton:
            by_kernel[name] = by_kernel.get(name, 0.0) + seconds
        return {
            "seconds": {k: round(sum(v), 3) for k, v in self.timers.spans.items()},
            "calls": {k: len(v) for k, v in self.timers.spans.items()},
            "triton_in_process_s": round(sum(s for _, s in self.triton), 3),
            "triton_in_process": {k: round(v, 3) for k, v in by_kernel.items()},
        }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--shape", default="llama-1.5b")
    parser.add_argument("--mode", default="full_and_piecewise")
    parser.add_argument("--compiler", default="auto", help="auto (Inductor), inductor, eager")
    parser.add_argument("--max-capture-size", type=int, default=512)
    parser.add_argument("--phases", action="store_true")
    parser.add_argument(
        "--compile-ahead", action="store_true", help="KernelOptions(compile_ahead=True)"
    )
    parser.add_argument(
        "--num-warmups", type=int, help="eager runs before each capture (GraphConfig; 1)"
    )
    return parser


def main() -> None:
    args = _parser().parse_args()
    caches = tempfile.mkdtemp(prefix="ostinato-cold-")
    # Before torch is imported: both compilers read these once.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{caches}/inductor"
    os.environ["TRITON_CACHE_DIR"] = f"{caches}/triton"
    start = time.perf_counter()
    import torch

    from ostinato.engine import LLM, KernelOptions

    imported = time.perf_counter() - start
    if args.num_warmups is not None:
        import functools

        from ostinato.engine.api import startup as llm_module

        # LLM takes no num_warmups (1 is its choice); the experiment sets it here.
        llm_module.GraphConfig = functools.partial(
            llm_module.GraphConfig, num_warmups=args.num_warmups
        )
    phases = Phases() if args.phases else None
    if phases:
        phases.install()
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    llm = LLM(
        args.shape,
        mode=args.mode,
        max_num_seqs=128,
        max_model_len=272,
        max_capture_size=args.max_capture_size,
        compiler=args.compiler,
        kernels=KernelOptions(compile_ahead=args.compile_ahead),
        progress=False,
    )
    torch.cuda.synchronize()
    if profiler:
        profiler.disable()
    total = time.perf_counter() - start
    doc = {
        "shape": args.shape,
        "mode": args.mode,
        "compiler": args.compiler,
        "compile_ahead": args.compile_ahead,
        "num_warmups": args.num_warmups,
        "max_capture_size": args.max_capture_size,
        "profiled": profiler is not None,
        "import_s": imported,
        "constructor_s": total,
        "startup": asdict(llm.startup),
        "graphs": llm.capture_report.num_graphs,
        "piece_compiles": llm.engine.runner.piecewise.stats.piece_compiles
        if llm.engine.runner.piecewise
        else 0,
        "piece_reuses": llm.engine.runner.piecewise.stats.piece_reuses
        if llm.engine.runner.piecewise
        else 0,
        "backend_s": llm.engine.runner.piecewise.stats.seconds
        if llm.engine.runner.piecewise
        else 0.0,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        # Every Triton compilation of the start-up (ours and Inductor's), by kernel name.
        "triton_compiles": _triton_census(Path(caches) / "triton"),
        "phases": phases.report() if phases else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    if profiler and args.profile:
        _write_profile(profiler, args.profile)
    sys.stdout.flush()


def _write_profile(profiler: cProfile.Profile, path: Path) -> None:
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats("ostinato", 50)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(30)
    path.write_text(text.getvalue())


if __name__ == "__main__":
    main()
