"""Whether a projection whose whole weight is loaded into registers before the PDL wait
beats the small GEMM's K loop at a few rows: a measurement, not a kernel of the engine.

The small GEMM (``small_gemm``) prefetches its weight into L2 before it waits for the
previous kernel, then walks it in a software-pipelined K loop, split over programs whose
partials the last one sums. A *resident* launch instead gives each program ``block_n``
weight rows over the whole of K and loads them into registers before the wait (letting
the next kernel launch first), so after the wait a program only loads its rows of
``x``, multiplies and stores: no K loop, no split-K reduction. The grid is large (``N /
block_n`` programs), so the weight of one projection is in flight at once.

Ways to multiply after the wait: ``fma`` (each row of ``x`` times the weight
tile, summed across the tile's columns: CUDA cores, a branch per row), ``rows`` (the
same with every row's load masked instead, so no load waits on a branch, and the rows'
sums assembled into one tile that is stored once, as the engine's epilogues need),
``hoist`` (as ``rows``, the rows loaded as one tile first), ``bcast`` (the products
of every row and column at once, summed over K) and ``dot`` (``tl.dot`` of the 16-row
``x`` with the tile: tensor cores; ``block_n`` of at least 16).

Every call reads its own weight copy (``fused_sweep.weight_turns``), PDL-launched back
to back in one CUDA graph; the small GEMM runs at its default launch shape
(``gemm_launch.pick_config``) in the same run, in the same kind of chain.

``python -m benchmarks.resident_gemv --out results.json [--rows 1,8] [--kinds fma,dot,rows]``
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
from ostinato.engine.kernels import small_gemm as tg
from ostinato.engine.kernels.gemm_launch import pick_config
from ostinato.engine.kernels.launch import compile_ahead, launch, num_sms
from ostinato.platform.cuda import graph_call_us
from ostinato.provenance import Provenance

# name -> (N, K): a layer's projections at the 1.5 B preset and at SmolLM2 (gate/up as
# the fused kernel reads it, gate rows then up rows).
SHAPES = {
    "1.5b qkv": (3072, 2048),
    "1.5b o": (2048, 2048),
    "1.5b down": (2048, 8192),
    "1.5b gate_up": (16384, 2048),
    "smollm2 qkv": (960, 576),
    "smollm2 o": (576, 576),
    "smollm2 down": (576, 1536),
    "smollm2 gate_up": (3072, 576),
}


@dataclass(frozen=True)
class Timing:
    shape: str
    rows: int
    kernel: str  # "small_gemm <config>" or "resident <kind> n<block_n> w<warps>"
    us: float
    of_copy: float  # the weight's bytes over the time, against the copy bandwidth


@triton.jit
def _resident(
    x_ptr, w_ptr, out_ptr, M, N, K, KIND: tl.constexpr, BLOCK_N: tl.constexpr,
    K_P2: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, K_P2)
    tl.extra.cuda.gdc_launch_dependents()
    w_mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=w_mask, other=0.0)
    tl.extra.cuda.gdc_wait()
    rm = tl.arange(0, ROWS)
    if KIND == 1:  # dot
        x = tl.load(
            x_ptr + rm[:, None] * K + rk[None, :],
            mask=(rm[:, None] < M) & (rk[None, :] < K),
            other=0.0,
        )
        acc = tl.dot(x, tl.trans(w))
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=mask)
    elif KIND == 0:  # fma: a branch per row
        wf = w.to(tl.float32)
        for m in tl.static_range(ROWS):
            if m < M:
                x = tl.load(x_ptr + m * K + rk, mask=rk < K, other=0.0).to(tl.float32)
                acc = tl.sum(wf * x[None, :], axis=1)
                tl.store(out_ptr + m * N + rn, acc.to(tl.bfloat16), mask=rn < N)
    else:
        wf = w.to(tl.float32)
        acc = tl.zeros((ROWS, BLOCK_N), tl.float32)
        if KIND == 2:  # rows: every row's load masked (no branch), the tile assembled
            for m in tl.static_range(ROWS):
                x = tl.load(x_ptr + m * K + rk, mask=(rk < K) & (m < M), other=0.0)
                row = tl.sum(wf * x.to(tl.float32)[None, :], axis=1)
                acc = tl.where(rm[:, None] == m, row[None, :], acc)
        else:
            xs = tl.load(
                x_ptr + rm[:, None] * K + rk[None, :],
                mask=(rm[:, None] < M) & (rk[None, :] < K),
                other=0.0,
            ).to(tl.float32)
            if KIND == 3:  # hoist: the rows loaded at once, then as ``rows``
                for m in tl.static_range(ROWS):
                    x = tl.sum(tl.where(rm[:, None] == m, xs, 0.0), axis=0)
                    row = tl.sum(wf * x[None, :], axis=1)
                    acc = tl.where(rm[:, None] == m, row[None, :], acc)
            else:  # bcast: the products of every row at once
                acc = tl.sum(xs[:, None, :] * wf[None, :, :], axis=2)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=mask)


KINDS = {"fma": 0, "dot": 1, "rows": 2, "hoist": 3, "bcast": 4}


def launch_resident(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, kind: str, block_n: int, warps: int
) -> torch.Tensor:
    """``out = x @ w.T`` (``x`` ``[M, K]``, at most 16 rows) by a resident launch."""
    n, k = w.shape
    rows = 16 if kind == "dot" else triton.next_power_of_2(x.shape[0])
    launch(
        _resident, (triton.cdiv(n, block_n),), x, w, out, x.shape[0], n, k, KIND=KINDS[kind],
        BLOCK_N=block_n, K_P2=triton.next_power_of_2(k), ROWS=rows, num_warps=warps,
        launch_pdl=True,
    )  # fmt: skip
    return out


def _variants(k: int, kinds: list[str]) -> list[tuple[str, int, int]]:
    """(kind, block_n, warps) of ``kinds`` whose weight tile is at most 128 KiB."""
    fma = (2, 4, 8, 16)
    shapes = {"fma": fma, "rows": fma, "hoist": fma, "bcast": fma, "dot": (16, 32)}
    every = [itertools.product((kind,), shapes[kind], (4, 8)) for kind in kinds]
    fits = lambda bn: bn * triton.next_power_of_2(k) * 2 <= 128 * 1024  # noqa: E731
    return [(kind, bn, w) for kind, bn, w in itertools.chain(*every) if fits(bn)]


@dataclass
class Case:
    """One shape at one row count: a call of each kernel over the weight's cold copies."""

    shape: str
    rows: int
    calls: int
    runs: dict[str, Callable[[], torch.Tensor]]  # each returns its output
    expected: torch.Tensor  # [rows, N] float32


def case(name: str, rows: int, kinds: list[str]) -> Case:
    """The small GEMM's default and every resident variant at ``rows`` rows of ``name``."""
    n, k = SHAPES[name]
    dev = torch.device("cuda")
    bf = dict(device=dev, dtype=torch.bfloat16)
    turn, calls = weight_turns(torch.randn(n, k, **bf) / 30, cold=True)
    x = torch.randn(rows, k, **bf)
    out = torch.empty(rows, n, **bf)
    counters = torch.zeros(tg.counters_needed(n), dtype=torch.int32, device=dev)
    config = tg.CONFIGS[pick_config(n, k, num_sms(dev)) - 1]
    label = f"small_gemm {config.block_n}x{config.split_k} k{config.block_k}"
    runs = {label: lambda: tg.small_gemm(x, turn(), None, counters, config, pdl=True)}
    for kind, bn, warps in _variants(k, kinds):
        runs[f"resident {kind} n{bn} w{warps}"] = lambda kind=kind, bn=bn, warps=warps: (
            launch_resident(x, turn(), out, kind, bn, warps)
        )
    return Case(name, rows, calls, runs, x.float() @ turn().float().T)


def timings(c: Case, bw_gbps: float) -> list[Timing]:
    """Each of ``c``'s kernels timed (those that do not compile are left out, said why)."""
    n, k = SHAPES[c.shape]
    out = []
    for label, run in c.runs.items():
        try:
            got = run().float()
        except Exception as e:  # a variant past the registers or shared memory
            print(f"   {label}: {type(e).__name__}: {str(e)[:120]}")
            continue
        err = (got - c.expected).abs().max().item() / c.expected.abs().max().item()
        if err > 2e-2:
            print(f"   {label}: wrong, max error {err:.3g} of the largest output")
            continue
        us = graph_call_us(run, c.calls)
        out.append(Timing(c.shape, c.rows, label, us, n * k * 2 / us / 1e3 / bw_gbps))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--kinds", default="fma,dot", help="of fma, dot, rows, hoist, bcast")
    parser.add_argument("--shapes", default=",".join(s.replace(" ", ":") for s in SHAPES))
    args = parser.parse_args()
    bw = copy_bandwidth_gbps(torch.device("cuda"))
    doc = {"benchmark": "resident_gemv", "provenance": asdict(Provenance.collect())}
    doc["copy_bandwidth_gbps"] = bw
    doc["timings"] = []
    names = [s.replace(":", " ") for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    kinds = args.kinds.split(",")
    cases = [case(n, r, kinds) for n, r in itertools.product(names, rows)]
    with compile_ahead():  # every variant's compilation on a pool, ahead of timing
        for c in cases:
            for run in c.runs.values():
                try:
                    run()
                except Exception:  # reported where it is timed
                    pass
    for c in cases:
        found = timings(c, bw)
        doc["timings"] += [asdict(t) for t in found]
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        base = found[0]
        print(f"{c.shape} B={c.rows}: {base.kernel} {base.us:.2f} us ({base.of_copy:.0%})")
        for t in sorted(found[1:], key=lambda t: t.us)[:4]:
            print(f"   {t.kernel:24s} {t.us:7.2f} us ({t.of_copy:.0%})", flush=True)


if __name__ == "__main__":
    main()
