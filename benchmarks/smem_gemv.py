"""Whether a projection whose weight waits in *shared memory* across the PDL wait, and is
multiplied on tensor cores after it, beats the small GEMM's K loop at 2 to 16 rows: a
measurement, not a kernel of the engine.

The resident launch (``small_gemm``'s, one and two rows) holds its weight in registers
before the wait and multiplies on CUDA cores, whose cost grows with the rows; at 8 rows
the K loop wins (``resident_gemv``). Triton cannot keep a tile in shared memory across
the wait, but Gluon (Triton's lower-level dialect, ``triton.experimental.gluon``) can:

- Each program owns ``BN`` weight rows over the whole of K. Before its PDL wait it lets
  the next kernel launch and starts ``cp.async`` copies of those rows into shared memory,
  ``[G, BN, K / G]``: K cut into one chunk per warp.
- After the wait it copies the rows of ``x`` (``[G, MP, K / G]``, rows past M zero-filled),
  waits for both, and each warp multiplies its chunk with ``mma.sync`` (a batched
  ``w @ x^T``, the weight as the 16-row operand, so the rows pad only to 8).
- The warps' products are summed (``sum`` over the chunk axis) and stored.

No split-K, no counter, no K loop in flight after the wait. The weight is ``BN * K * 2``
bytes of shared memory a program, ``x`` ``MP * K * 2``.

``python -m benchmarks.smem_gemv --out results.json [--rows 1,2,8,16]``
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from benchmarks.decode import copy_bandwidth_gbps
from benchmarks.fused_sweep import weight_turns
from benchmarks.resident_gemv import SHAPES, Case, launch_resident, timings
from ostinato.engine.kernels import small_gemm as tg
from ostinato.engine.kernels.gemm_launch import pick_config
from ostinato.engine.kernels.launch import compile_ahead, num_sms
from ostinato.provenance import Provenance

SMEM_BYTES = 227 * 1024  # an H100/H200 SM's shared memory a program may hold


@gluon.jit
def _pdl_trigger_then_wait():
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; griddepcontrol.wait; mov.u32 $0, 0;",
        "=r", [], dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _smem_gemv(
    x_ptr, w_ptr, out_ptr, M, N, K: gl.constexpr, BN: gl.constexpr, MP: gl.constexpr,
    G: gl.constexpr, KS: gl.constexpr,
):  # fmt: skip
    KC: gl.constexpr = K // G
    KCP: gl.constexpr = triton.next_power_of_2(KC)  # a buffer's sides are powers of two
    n0 = gl.program_id(0) * BN
    copy: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [G, 1, 1], [2, 1, 0])
    shared: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0])
    ws = gl.allocate_shared_memory(gl.bfloat16, [G, BN, KCP], shared)
    xs = gl.allocate_shared_memory(gl.bfloat16, [G, MP, KCP], shared)
    g = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, copy)))
    k = gl.arange(0, KS, layout=gl.SliceLayout(0, gl.SliceLayout(1, copy)))
    n = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, copy)))
    rows = gl.minimum(n0 + n, N - 1)  # past N: the last row again (outputs masked)
    cols = g[:, None, None] * KC + k[None, None, :]
    w_base = w_ptr + rows[None, :, None] * K + cols
    for s in gl.static_range(KC // KS):
        cp.async_copy_global_to_shared(ws.slice(s * KS, KS, dim=2), w_base + s * KS)
    cp.commit_group()
    _pdl_trigger_then_wait()
    m = gl.arange(0, MP, layout=gl.SliceLayout(0, gl.SliceLayout(2, copy)))
    x_base = x_ptr + m[None, :, None] * K + cols
    x_mask = (m[None, :, None] < M) & (cols < K)
    for s in gl.static_range(KC // KS):
        cp.async_copy_global_to_shared(xs.slice(s * KS, KS, dim=2), x_base + s * KS, x_mask)
    cp.commit_group()
    cp.wait_group(0)
    gl.thread_barrier()
    mma: gl.constexpr = gl.NVMMADistributedLayout([2, 0], [G, 1, 1], [1, 16, 8])
    acc = gl.zeros([G, BN, MP], gl.float32, mma)
    for s in gl.static_range(KC // KS):
        a = ws.slice(s * KS, KS, dim=2).load(gl.DotOperandLayout(0, mma, 2))
        b = xs.slice(s * KS, KS, dim=2).permute([0, 2, 1]).load(gl.DotOperandLayout(1, mma, 2))
        acc = mma_v2(a, b, acc)
    y = gl.sum(acc, axis=0)  # [BN, MP]
    on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, y.type.layout))
    om = gl.arange(0, MP, layout=gl.SliceLayout(0, y.type.layout))
    mask = (on[:, None] < N) & (om[None, :] < M)
    gl.store(out_ptr + om[None, :] * N + on[:, None], y.to(gl.bfloat16), mask=mask)


def k_step(k: int, warps: int) -> int:
    """K columns per mma step: the most of 64, 32 and 16 that cut a warp's chunk evenly
    (0 where none does)."""
    return next((s for s in (64, 32, 16) if k % (warps * s) == 0), 0)


def smem_fits(k: int, bn: int, rows: int, warps: int) -> bool:
    """Whether a program's tiles fit an SM's shared memory and K cuts into whole steps."""
    mp = 8 if rows <= 8 else 16
    kcp = triton.next_power_of_2(k // warps)
    return (bn + mp) * warps * kcp * 2 <= SMEM_BYTES and k_step(k, warps) > 0


def launch_smem(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bn: int, warps: int
) -> torch.Tensor:
    """``out = x @ w.T`` (``x`` ``[M, K]``, at most 16 rows) with the weight in shared
    memory across the PDL wait."""
    n, k = w.shape
    mp = 8 if x.shape[0] <= 8 else 16
    _smem_gemv[(triton.cdiv(n, bn),)](
        x, w, out, x.shape[0], n, K=k, BN=bn, MP=mp, G=warps, KS=k_step(k, warps),
        num_warps=warps,
        launch_pdl=True,
    )  # fmt: skip
    return out


def case(name: str, rows: int) -> Case:
    """The small GEMM's default, the register-resident ``fma`` launch and every fitting
    shared-memory launch at ``rows`` rows of ``name``."""
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
    if rows <= 2 and 4 * triton.next_power_of_2(k) * 2 <= 64 * 1024:
        runs["resident fma n4 w4"] = lambda: launch_resident(x, turn(), out, "fma", 4, 4)
    for bn, warps in itertools.product((16, 32, 64), (4, 8)):
        if smem_fits(k, bn, rows, warps):
            runs[f"smem n{bn} w{warps}"] = lambda bn=bn, warps=warps: launch_smem(
                x, turn(), out, bn, warps
            )
    return Case(name, rows, calls, runs, x.float() @ turn().float().T)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1,2,8,16")
    parser.add_argument("--shapes", default=",".join(s.replace(" ", ":") for s in SHAPES))
    args = parser.parse_args()
    bw = copy_bandwidth_gbps(torch.device("cuda"))
    doc = {"benchmark": "smem_gemv", "provenance": asdict(Provenance.collect())}
    doc["copy_bandwidth_gbps"] = bw
    doc["timings"] = []
    names = [s.replace(":", " ") for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    cases = [case(n, r) for n, r in itertools.product(names, rows)]
    with compile_ahead():
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
        for t in found:
            print(f"{c.shape} B={c.rows}: {t.kernel:24s} {t.us:7.2f} us ({t.of_copy:.0%})")


if __name__ == "__main__":
    main()
