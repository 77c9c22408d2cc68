"""Where a fused decode kernel's time goes beyond reading its weight: each of a layer's
four GEMM kernels at its default launch shape, built up one part at a time, each timed
cold (every call reads its own weight copy, ``fused_sweep.COLD_BYTES`` of them) in a
CUDA graph of PDL launches back to back:

- ``stream``: ``weight_stream``'s grid at the same rows per program, splits and K step
  (the weight read and nothing else);
- ``gemm``: the small GEMM, plain epilogue (with splits, its reduction);
- ``+norm``: the norm prologue fed by row statistics and the residual (QKV, gate/up);
- ``+rope``, ``+swiglu``, ``+stats``: the kernel's own epilogue, which with the norm
  makes the kernel the decode step runs.

With ``--grid``, each whole kernel instead, at its default tile and splits under other
warps, pipeline stages and K steps.

``python -m benchmarks.kernel_anatomy --out results.json [--shapes smollm2,llama-1.5b]
[--rows 1,8] [--grid]``
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import triton

from benchmarks import weight_stream
from benchmarks.decode import copy_bandwidth_gbps
from benchmarks.fused_sweep import SHAPES, weight_turns
from ostinato.platform.cuda import graph_call_us
from ostinato.provenance import Provenance

EPS = 1e-5


@dataclass(frozen=True)
class Timing:
    shape: str
    rows: int
    kernel: str
    part: str
    config: str
    us: float
    floor_us: float  # the weight's bytes over the copy bandwidth


def _stream(w: torch.Tensor, block_n: int, split: int, block_k: int, stages: int):
    launch = weight_stream.Launch(block_n, split, block_k, stages, 4, "rows")
    x = torch.ones(weight_stream.ROWS, block_k, device=w.device, dtype=w.dtype)
    out = torch.empty(split, weight_stream.ROWS, w.shape[0], device=w.device)
    return lambda wt: weight_stream.launch_stream(launch, x, wt, out)


def _parts(
    name: str, rows: int, tweak: Callable[[Any], Any] = lambda c: c
) -> dict[str, list[tuple[str, str, torch.Tensor, Callable]]]:
    """kernel -> [(part, config label, weight, call taking a weight copy)], each kernel's
    default launch shape passed through ``tweak`` first."""
    from ostinato.engine.kernels import small_gemm as tg
    from ostinato.engine.kernels.gemm_launch import GemmConfig, k_step, pick_config, rope_split_k
    from ostinato.engine.kernels.launch import num_sms

    hidden, heads, kv_heads, d, inter = SHAPES[name]
    dev = torch.device("cuda")
    sms = num_sms(dev)
    bf = dict(device=dev, dtype=torch.bfloat16)
    split = rope_split_k(heads + 2 * kv_heads, hidden, sms)
    cfg = {
        "qkv": GemmConfig(d // 2, split, block_k=k_step(hidden, split)),
        "o": tg.CONFIGS[pick_config(hidden, heads * d, sms) - 1],
        "gate_up": tg.CONFIGS[pick_config(inter, hidden, sms, swiglu=True) - 1],
        "down": tg.CONFIGS[pick_config(hidden, inter, sms) - 1],
    }
    cfg = {k: tweak(c) for k, c in cfg.items()}
    w = {
        "qkv": torch.randn((heads + 2 * kv_heads) * d, hidden, **bf) / 30,
        "o": torch.randn(hidden, heads * d, **bf) / 30,
        "gate_up": torch.randn(2 * inter, hidden, **bf) / 30,
        "down": torch.randn(hidden, inter, **bf) / 30,
    }
    cnt = torch.zeros(4096, dtype=torch.int32, device=dev)
    x = {k: torch.randn(rows, v.shape[1], **bf) for k, v in w.items()}
    res = torch.randn(rows, hidden, **bf)
    total = torch.empty_like(res)
    stats_in = torch.rand(tg.MAX_ROWS, tg.stats_columns(hidden), device=dev) * hidden
    norm = tg.NormPrologue(torch.ones(hidden, **bf), EPS, res, total, stats_in)
    after = tg.ResidualStats(res, torch.zeros(tg.MAX_ROWS, tg.stats_columns(hidden), device=dev))
    cache = torch.zeros(64, 16, kv_heads, d, **bf)
    cos = torch.ones(rows, 1, d, **bf)
    slots = torch.arange(rows, device=dev) + 16
    rope = tg.RopeKV(cos, cos, cache, cache.clone(), slots, heads, kv_heads)
    q = torch.empty(rows, heads * d, **bf)
    head = replace(cfg["qkv"], block_n=d)  # a program's rows, as a plain GEMM tile
    gu = cfg["gate_up"]

    def label(c: GemmConfig) -> str:
        return f"{c.block_n}x{c.split_k} k{c.block_k} s{c.num_stages} w{c.num_warps}"

    def stream(k: str, bn: int, c: GemmConfig):
        return ("stream", label(c), w[k], _stream(w[k], bn, c.split_k, c.block_k, c.num_stages))

    def gemm(k: str, c: GemmConfig, part: str, **kw):
        def call(wt: torch.Tensor) -> object:
            return tg.small_gemm(x[k], wt, None, cnt, c, pdl=True, **kw)

        return (part, label(c), w[k], call)

    def qkv(part: str, n: tg.NormPrologue | None):
        def call(wt: torch.Tensor) -> object:
            return tg.qkv_rope_kv(x["qkv"], wt, None, cnt, cfg["qkv"], rope, n, True, out=q)

        return (part, label(cfg["qkv"]), w["qkv"], call)

    return {
        "qkv": [
            stream("qkv", d, cfg["qkv"]),
            gemm("qkv", head, "gemm"),
            gemm("qkv", head, "+norm", norm=norm),
            qkv("+rope", None),
            qkv("+norm+rope", norm),
        ],
        "o": [
            stream("o", cfg["o"].block_n, cfg["o"]),
            gemm("o", cfg["o"], "gemm"),
            gemm("o", cfg["o"], "+stats", after=after),
        ],
        "gate_up": [
            stream("gate_up", 2 * gu.block_n, gu),
            gemm("gate_up", gu, "+swiglu", swiglu=True),
            gemm("gate_up", gu, "+norm+swiglu", swiglu=True, norm=norm),
        ],
        "down": [
            stream("down", cfg["down"].block_n, cfg["down"]),
            gemm("down", cfg["down"], "gemm"),
            gemm("down", cfg["down"], "+stats", after=after),
        ],
    }


def _tweaks() -> list[Callable[[Any], Any]]:
    """The whole kernels' launch shapes tried by ``--grid``: each default's tile and
    splits at 4 or 8 warps, 2 to 4 stages, K steps of 128 or 256."""
    shapes = itertools.product((4, 8), (2, 3, 4), (128, 256))
    return [
        lambda c, w=w, s=s, k=k: replace(c, num_warps=w, num_stages=s, block_k=k)
        for w, s, k in shapes
    ]


def measure(name: str, rows: int, bw_gbps: float, grid: bool = False) -> list[Timing]:
    """Each kernel part by part; with ``grid``, each whole kernel at every ``_tweaks``."""
    from ostinato.engine.kernels.launch import compile_ahead

    if grid:
        runs = [
            {k: parts[-1:] for k, parts in _parts(name, rows, tweak).items()} for tweak in _tweaks()
        ]
        with compile_ahead():  # every shape's compilation on a pool, ahead of timing
            for run in runs:
                for parts in run.values():
                    parts[0][3](parts[0][2])
    else:
        runs = [_parts(name, rows)]
    out = []
    for kernel, parts in ((k, p) for run in runs for k, p in run.items()):
        for part, config, w, call in parts:
            turn, calls = weight_turns(w, cold=True)
            try:
                call(w)  # compiles outside the capture
            except triton.runtime.errors.OutOfResources:
                continue  # a pipeline that does not fit in shared memory
            us = graph_call_us(lambda call=call, turn=turn: call(turn()), calls)
            floor = w.nbytes / bw_gbps / 1e3
            out.append(Timing(name, rows, kernel, part, config, us, floor))
            print(f"{name:10s} rows {rows:2d} {kernel:8s} {part:12s} {config:18s} "
                  f"{us:6.2f} us (floor {floor:5.2f})", flush=True)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--grid", action="store_true", help="whole kernels, other launch shapes")
    args = parser.parse_args()
    bw = copy_bandwidth_gbps(torch.device("cuda"))
    doc = {"benchmark": "kernel_anatomy", "provenance": asdict(Provenance.collect())}
    doc["copy_bandwidth_gbps"] = bw
    doc["timings"] = []
    for name in args.shapes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            doc["timings"] += [asdict(t) for t in measure(name, rows, bw, args.grid)]
            args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
