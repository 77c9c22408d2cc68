"""How fast a Triton program grid can stream a projection's weight, with nothing else to
do: the ceiling of the small GEMM's launch shapes, apart from its norm, split-K reduction
and epilogues.

Each program of a ``(N / block_n, split)`` grid walks its ``block_n`` weight rows over
``K / split`` columns (in whole steps, the last split masked), ``block_k`` at a time, as
``small_gemm``'s K loop does: a software-pipelined load of the tile fed to ``tl.dot``
with a 16-row ``x`` (loaded once, outside the loop); it stores its float32 partial (no
reduction). The weight is laid out either as the model holds it (``rows``: ``[N, K]``,
a tile is ``block_n`` strided runs of ``block_k`` columns) or pre-tiled (``tiled``:
``[N / block_n, K / block_k, block_n, block_k]``, so each tile, and a program's whole
walk, is one contiguous run).

Every call reads its own copy of the weight (``fused_sweep.weight_turns``: the copies
together over its ``COLD_BYTES``), as a decode step reads each layer's weights once;
calls are PDL-launched back to back in one CUDA graph (``graph_call_us``), and the rate
is against the copy bandwidth measured in the same run.

``python -m benchmarks.weight_stream --out results.json [--shapes gate_up,down,qkv,o]``
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.decode import copy_bandwidth_gbps
from benchmarks.fused_sweep import weight_turns
from ostinato.engine.kernels.gemm_launch import k_per_split
from ostinato.engine.kernels.launch import compile_ahead, launch
from ostinato.engine.kernels.pdl import pdl_enter
from ostinato.platform.cuda import graph_call_us
from ostinato.provenance import Provenance

# The 1.5 B preset's projections at one layer: name -> (N, K); gate/up as the fused
# kernel reads it (gate rows, then up rows).
SHAPES = {"gate_up": (16384, 2048), "down": (2048, 8192), "qkv": (3072, 2048), "o": (2048, 2048)}
ROWS = 16  # the GEMM's row tile


@dataclass(frozen=True)
class Launch:
    """One launch shape: rows per program, K splits, K columns per step, stages, warps,
    and the weight's layout."""

    block_n: int
    split: int
    block_k: int
    stages: int
    warps: int
    layout: str

    def label(self) -> str:
        return (
            f"{self.layout} {self.block_n}x{self.split} k{self.block_k} "
            f"s{self.stages} w{self.warps}"
        )


@dataclass(frozen=True)
class Timing:
    shape: str
    launch: Launch
    us: float
    gbps: float
    of_copy: float  # fraction of the copy bandwidth measured in the same run


@triton.jit
def _stream(
    x_ptr, w_ptr, out_ptr, N, K, K_PER, TILED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, ROWS)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    pdl_enter(True)
    x = tl.load(x_ptr + rm[:, None] * BLOCK_K + rk[None, :])
    acc = tl.zeros((ROWS, BLOCK_N), tl.float32)
    k_lo = pid_k * K_PER
    for k0 in range(0, K_PER, BLOCK_K):
        if TILED:
            tile = pid_n * (K // BLOCK_K) + (k_lo + k0) // BLOCK_K
            ptrs = w_ptr + tile * (BLOCK_N * BLOCK_K) + rn[None, :] * BLOCK_K + rk[:, None]
            w = tl.load(ptrs)
        else:
            ks = k_lo + k0 + rk
            ptrs = w_ptr + (pid_n * BLOCK_N + rn)[None, :] * K + ks[:, None]
            w = tl.load(ptrs, mask=ks[:, None] < K, other=0.0)
        acc = tl.dot(x, w, acc)
    out = out_ptr + pid_k * ROWS * N + rm[:, None] * N + (pid_n * BLOCK_N + rn)[None, :]
    tl.store(out, acc)


def _tiled(w: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    n, k = w.shape
    return w.view(n // block_n, block_n, k // block_k, block_k).transpose(1, 2).contiguous()


def _launches() -> list[Launch]:
    grid = itertools.product((16, 32, 64), (1, 2, 4, 8), (128, 256, 512), (2, 3, 4), (4, 8))
    return [
        Launch(n, s, k, st, w, layout)
        for (n, s, k, st, w), layout in itertools.product(grid, ("rows", "tiled"))
        # a pipeline of more than ~200 KiB of shared memory does not fit
        if (st - 1) * (n + ROWS) * k * 2 <= 200 * 1024
    ]


def launch_stream(launch_: Launch, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """One launch over ``w`` (``[N, K]`` elements in either layout) into ``out``
    (``[split, ROWS, N]``)."""
    n = out.shape[2]
    k = w.numel() // n
    k_per = k_per_split(k, launch_.split, launch_.block_k)
    launch(
        _stream, (n // launch_.block_n, launch_.split), x, w, out, n, k, k_per,
        TILED=launch_.layout == "tiled", BLOCK_N=launch_.block_n, BLOCK_K=launch_.block_k,
        ROWS=ROWS, num_warps=launch_.warps, num_stages=launch_.stages, launch_pdl=True,
    )  # fmt: skip


def _time(
    c: Launch, x: torch.Tensor, turns: tuple[Callable[[], torch.Tensor], int], n: int
) -> float | None:
    """µs per call of ``c`` over a weight's cold copies (``turns``, from
    ``fused_sweep.weight_turns``); None where it does not fit."""
    turn, calls = turns
    outs = torch.empty(c.split, ROWS, n, device="cuda", dtype=torch.float32)
    try:
        launch_stream(c, x, turn(), outs)
    except triton.runtime.errors.OutOfResources:
        return None
    return graph_call_us(lambda: launch_stream(c, x, turn(), outs), calls)


def sweep(name: str, bw_gbps: float, launches: list[Launch]) -> list[Timing]:
    """Every launch shape that fits ``name``'s weight, timed cold."""
    n, k = SHAPES[name]
    bf = dict(device="cuda", dtype=torch.bfloat16)
    base = torch.randn(n, k, **bf) / 30
    fits = [c for c in launches if k % (c.split * c.block_k) == 0]
    out: list[Timing] = []
    key = lambda c: (c.layout, c.block_n, c.block_k)  # noqa: E731
    for (layout, bn, bk), group in itertools.groupby(sorted(fits, key=key), key=key):
        turns = weight_turns(_tiled(base, bn, bk) if layout == "tiled" else base, cold=True)
        x = torch.ones(ROWS, bk, **bf)
        for c in group:
            us = _time(c, x, turns, n)
            if us is not None:
                gbps = base.nbytes / us / 1e3
                out.append(Timing(name, c, us, gbps, gbps / bw_gbps))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    bw = copy_bandwidth_gbps(torch.device("cuda"))
    launches = _launches()
    x = torch.ones(ROWS, 512, device="cuda", dtype=torch.bfloat16)
    with compile_ahead():  # every layout's compilation on a pool, ahead of timing
        for c in launches:
            w = torch.empty(64, 4096, device="cuda", dtype=torch.bfloat16)
            launch_stream(c, x[:, : c.block_k], w, torch.empty(1, ROWS, 64, device="cuda"))
    doc = {"benchmark": "weight_stream", "provenance": asdict(Provenance.collect())}
    doc["copy_bandwidth_gbps"] = bw
    doc["timings"] = []
    for name in args.shapes.split(","):
        timings = sweep(name, bw, launches)
        doc["timings"] += [asdict(t) for t in timings]
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        for t in sorted(timings, key=lambda t: t.us)[:8]:
            print(f"{name:8s} {t.launch.label():28s} {t.us:7.2f} us  {t.of_copy:5.1%} of copy")
        for layout in ("rows", "tiled"):
            best = min((t for t in timings if t.launch.layout == layout), key=lambda t: t.us)
            print(f"{name:8s} best {layout}: {best.launch.label()} {best.of_copy:5.1%}")


if __name__ == "__main__":
    main()
