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

A third layout, ``tma``, keeps the model's ``[N, K]`` weight but reads it as Hopper's
tensor-memory accelerator does: each tile one bulk copy through a host tensor
descriptor, and the product taken the other way round (``w @ x^T``, so the weight tile
is the MMA's 64-row operand and ``tl.dot`` becomes a warpgroup MMA; ``block_n`` of at
least 64).

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
from triton.tools.tensor_descriptor import TensorDescriptor

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
def _program_start(
    x_ptr, K_PER, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr
):  # fmt: skip
    """A program's column tile, first K column, index ranges and its ``x`` (loaded after
    the PDL wait, once: the stream reuses it at every step)."""
    pid_n = tl.program_id(0)
    rm = tl.arange(0, ROWS)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    pdl_enter(True)
    x = tl.load(x_ptr + rm[:, None] * BLOCK_K + rk[None, :])
    return pid_n, tl.program_id(1) * K_PER, rm, rn, rk, x


@triton.jit
def _stream(
    x_ptr, w_ptr, out_ptr, N, K, K_PER, TILED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid_n, k_lo, rm, rn, rk, x = _program_start(x_ptr, K_PER, BLOCK_N, BLOCK_K, ROWS)
    acc = tl.zeros((ROWS, BLOCK_N), tl.float32)
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
    out = out_ptr + tl.program_id(1) * ROWS * N + rm[:, None] * N + (pid_n * BLOCK_N + rn)[None, :]
    tl.store(out, acc)


@triton.jit
def _stream_tma(
    x_ptr, w_desc, out_ptr, N, K_PER, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    pid_n, k_lo, rm, rn, _, x = _program_start(x_ptr, K_PER, BLOCK_N, BLOCK_K, ROWS)
    xt = tl.trans(x)
    acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
    for k0 in tl.range(0, K_PER, BLOCK_K, num_stages=STAGES):
        acc = tl.dot(w_desc.load([pid_n * BLOCK_N, k_lo + k0]), xt, acc)
    out = out_ptr + tl.program_id(1) * ROWS * N + rm[None, :] * N + (pid_n * BLOCK_N + rn)[:, None]
    tl.store(out, acc)


def _tiled(w: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    n, k = w.shape
    return w.view(n // block_n, block_n, k // block_k, block_k).transpose(1, 2).contiguous()


LAYOUTS = ("rows", "tiled", "tma")


def _valid(c: Launch) -> bool:
    """Whether ``c`` fits: a pipeline of more than ~200 KiB of shared memory does not; a
    TMA box spans at most 256 elements a side, and a warpgroup MMA 64 weight rows per
    warpgroup (the other layouts keep to at most 64 rows)."""
    if (c.stages - 1) * (c.block_n + ROWS) * c.block_k * 2 > 200 * 1024:
        return False
    if c.layout == "tma":
        return c.block_k <= 256 and c.block_n >= 64 * (c.warps // 4)
    return c.block_n <= 64


def _launches(layouts: tuple[str, ...] = LAYOUTS) -> list[Launch]:
    grid = itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (128, 256, 512), (2, 3, 4), (4, 8))
    every = itertools.product(grid, layouts)
    return [c for c in (Launch(*g, lay) for g, lay in every) if _valid(c)]


def launch_stream(launch_: Launch, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """One launch over ``w`` (``[N, K]`` elements in either layout) into ``out``
    (``[split, ROWS, N]``)."""
    n = out.shape[2]
    k = w.numel() // n
    k_per = k_per_split(k, launch_.split, launch_.block_k)
    if launch_.layout == "tma":
        launch(
            _stream_tma, (n // launch_.block_n, launch_.split), x, _descriptor(w, launch_),
            out, n, k_per, BLOCK_N=launch_.block_n, BLOCK_K=launch_.block_k, ROWS=ROWS,
            STAGES=launch_.stages, num_warps=launch_.warps, launch_pdl=True,
        )  # fmt: skip
        return
    launch(
        _stream, (n // launch_.block_n, launch_.split), x, w, out, n, k, k_per,
        TILED=launch_.layout == "tiled", BLOCK_N=launch_.block_n, BLOCK_K=launch_.block_k,
        ROWS=ROWS, num_warps=launch_.warps, num_stages=launch_.stages, launch_pdl=True,
    )  # fmt: skip


_DESCRIPTORS: dict[tuple[int, int, int], TensorDescriptor] = {}


def _descriptor(w: torch.Tensor, launch_: Launch) -> TensorDescriptor:
    """A tensor descriptor of ``w`` in ``launch_``'s tiles, made once per weight copy."""
    key = (w.data_ptr(), launch_.block_n, launch_.block_k)
    if key not in _DESCRIPTORS:
        _DESCRIPTORS[key] = TensorDescriptor.from_tensor(w, [launch_.block_n, launch_.block_k])
    return _DESCRIPTORS[key]


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
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    bw = copy_bandwidth_gbps(torch.device("cuda"))
    layouts = tuple(args.layouts.split(","))
    launches = _launches(layouts)
    x = torch.ones(ROWS, 512, device="cuda", dtype=torch.bfloat16)
    with compile_ahead():  # every layout's compilation on a pool, ahead of timing
        for c in launches:
            w = torch.empty(128, 4096, device="cuda", dtype=torch.bfloat16)
            launch_stream(c, x[:, : c.block_k], w, torch.empty(1, ROWS, 128, device="cuda"))
    doc = {"benchmark": "weight_stream", "provenance": asdict(Provenance.collect())}
    doc["copy_bandwidth_gbps"] = bw
    doc["timings"] = []
    for name in args.shapes.split(","):
        timings = sweep(name, bw, launches)
        doc["timings"] += [asdict(t) for t in timings]
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        for t in sorted(timings, key=lambda t: t.us)[:8]:
            print(f"{name:8s} {t.launch.label():28s} {t.us:7.2f} us  {t.of_copy:5.1%} of copy")
        for layout in layouts:
            best = min((t for t in timings if t.launch.layout == layout), key=lambda t: t.us)
            print(f"{name:8s} best {layout}: {best.launch.label()} {best.of_copy:5.1%}")


if __name__ == "__main__":
    main()
