"""Launch shapes of the fused decode kernels, measured: each of a layer's four GEMM
kernels (norm+QKV+RoPE+K/V write, O, norm+gate/up+SiLU·mul, down) at the SmolLM2 and
1.5 B shapes, for every (columns per program, K splits, warps), one row count at a time,
each captured as a graph of back-to-back PDL launches (``graph_call_us``), beside cuBLAS
for the plain projections and the weight-read floor at the measured copy bandwidth.

With ``--cold`` each call of a graph reads its own copy of the weight, the copies
together over ``COLD_BYTES`` (more than the L2 cache), as a decode step reads each
layer's weights once: the default repeats one weight, which then stays in L2.

``python -m benchmarks.fused_sweep --out results.json [--cold] [--shapes smollm2]``
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.decode import copy_bandwidth_gbps
from ostinato.platform.cuda import graph_call_us
from ostinato.provenance import Provenance

# name: (hidden, heads, kv heads, head dim, intermediate)
SHAPES = {"smollm2": (576, 9, 3, 64, 1536), "llama-1.5b": (2048, 32, 8, 64, 8192)}
CALLS = 20
COLD_BYTES = 160 * 2**20  # weight copies read in turn by a --cold graph: past any L2


@dataclass(frozen=True)
class Timing:
    """One kernel at one launch shape and row count: µs per call, and its weight-read
    floor (bytes over the copy bandwidth)."""

    shape: str
    kernel: str
    rows: int
    config: str
    us: float
    floor_us: float


def _configs() -> list:
    """The launch shapes tried: tile width, splits, warps, K step, pipeline stages."""
    from ostinato.engine.kernels.gemm_launch import GemmConfig

    tiles = (
        (16, 1, 4), (16, 2, 4), (32, 1, 4), (32, 2, 4), (32, 4, 4), (32, 8, 4), (64, 1, 8),
        (64, 4, 4), (64, 8, 4),
    )  # fmt: skip
    steps = ((128, 3), (256, 3), (128, 5), (256, 4))
    return [GemmConfig(*t, *st) for t, st in itertools.product(tiles, steps)]


def weight_turns(weight: torch.Tensor, cold: bool) -> tuple[Callable[[], torch.Tensor], int]:
    """A function giving the weight to read at each call (with ``cold`` the next of
    enough copies to fill ``COLD_BYTES``), and how many calls a graph should hold."""
    if not cold:
        return lambda: weight, CALLS
    copies = [weight] + [weight.clone() for _ in range(COLD_BYTES // weight.nbytes)]
    return itertools.cycle(copies).__next__, max(CALLS, len(copies))


def sweep(name: str, rows: int, bw_gbps: float, pdl: bool, cold: bool = False) -> list[Timing]:
    """Every launch shape of the four kernels at ``rows`` rows of shape ``name``."""
    from ostinato.engine.kernels import small_gemm as tg

    hidden, heads, kv_heads, d, inter = SHAPES[name]
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, res = torch.randn(rows, hidden, **bf), torch.randn(rows, hidden, **bf)
    norm = tg.NormPrologue(torch.ones(hidden, **bf), 1e-5, res, torch.empty_like(x))
    w = {
        "qkv": torch.randn((heads + 2 * kv_heads) * d, hidden, **bf) / 30,
        "o": torch.randn(hidden, heads * d, **bf) / 30,
        "gate_up": torch.randn(2 * inter, hidden, **bf) / 30,
        "down": torch.randn(hidden, inter, **bf) / 30,
    }
    inputs = {"o": torch.randn(rows, heads * d, **bf), "down": torch.randn(rows, inter, **bf)}
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    cache = torch.zeros(64, 16, kv_heads, d, **bf)
    cos = torch.ones(rows, 1, d, **bf)
    slots = torch.arange(rows, device="cuda") + 16
    rope = tg.RopeKV(cos, cos, cache, cache.clone(), slots, heads, kv_heads)
    out: list[Timing] = []
    turns = {k: weight_turns(v, cold) for k, v in w.items()}
    wt = {k: t[0] for k, t in turns.items()}  # the weight of the next call

    def timed(kernel: str, config: str, fn) -> None:
        try:
            fn()  # compiles outside the capture
        except triton.runtime.errors.OutOfResources:
            return  # a shape whose pipeline does not fit in shared memory
        floor = w[kernel].numel() * 2 / bw_gbps / 1e3
        label = config if config == "cublas" else f"{config}{' pdl' if pdl else ''}"
        label += " cold" if cold else ""
        us = graph_call_us(fn, turns[kernel][1])
        out.append(Timing(name, kernel, rows, label, us, floor))

    for c in _configs():
        label = f"{c.block_n}x{c.split_k} w{c.num_warps} k{c.block_k} s{c.num_stages}"
        if c.block_n == 32 and c.num_warps == 4:  # the head sets the QKV kernel's tile
            timed("qkv", label, lambda c=c: tg.qkv_rope_kv(
                x, wt["qkv"](), None, counters, c, rope, norm, pdl))  # fmt: skip
        timed("gate_up", label, lambda c=c: tg.small_gemm(
            x, wt["gate_up"](), None, counters, c, True, pdl, norm))  # fmt: skip
        for k in ("o", "down"):
            timed(k, label, lambda c=c, k=k: tg.small_gemm(
                inputs[k], wt[k](), None, counters, c, False, pdl))  # fmt: skip
    if pdl:
        for k in ("o", "down"):
            timed(k, "cublas", lambda k=k: F.linear(inputs[k], wt[k]()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cold", action="store_true", help="every call reads its own weight copy")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    bw = copy_bandwidth_gbps(torch.device("cuda"))
    timings = []
    for name in args.shapes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            timings += sweep(name, rows, bw, True, args.cold)
            best: dict[str, Timing] = {}
            for t in timings:
                if t.shape == name and t.rows == rows:
                    if t.kernel not in best or t.us < best[t.kernel].us:
                        best[t.kernel] = t
            for t in best.values():
                print(f"{name:10s} rows {rows:2d} {t.kernel:8s} best {t.config:14s} "
                      f"{t.us:6.2f} us (floor {t.floor_us:5.2f})")  # fmt: skip
    doc = {"provenance": asdict(Provenance.collect()), "copy_bandwidth_gbps": bw}
    doc["timings"] = [asdict(t) for t in timings]
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
