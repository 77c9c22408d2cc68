"""What a dependent step costs on this GPU, whatever the work: the floor under a decode
step built of many small kernels (or of one persistent kernel with grid barriers).

- ``hop``: a chain of ``HOPS`` kernels captured in one CUDA graph, each waiting for the
  one before (with PDL: ``griddepcontrol.wait``) and then making ``depth`` dependent
  loads from L2 before one store; µs per kernel, by program count, PDL on and off.
  ``depth`` 1 is the cheapest kernel a dependent chain can hold; the slope over depth is
  one dependent L2 round trip.
- ``barrier``: one launch of one program per SM passing ``HOPS`` grid barriers (the
  persistent decode kernel's ``_grid_sync``); µs per barrier, the launch subtracted.
- ``attention``: decode attention (KV 512, RoPE in the kernel, split keys and their
  merge kernel) at the SmolLM2 and 1.5 B shapes, 30 calls back to back with PDL in one
  graph; µs per call (two kernels).

``python -m benchmarks.latency_floor --out results.json``
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from ostinato.engine.kernels.persistent_decode import _grid_exit, _grid_sync

from benchmarks.attention_sweep import Case
from benchmarks.decode import SMOLLM2_CONFIG, model_config
from ostinato.engine.kernels.launch import num_sms
from ostinato.engine.kernels.paged_attention import paged_attention
from ostinato.engine.kernels.pdl import pdl_enter
from ostinato.engine.model.config import ModelConfig
from ostinato.platform.cuda import graph_call_us
from ostinato.provenance import Provenance

HOPS = 150  # dependent stages of a SmolLM2 decode step: 30 layers x 5 kernels


@triton.jit
def _hop_kernel(src_ptr, dst_ptr, DEPTH: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    # src holds its own indices: each load's address is the value of the one before.
    i = tl.load(src_ptr + pid, cache_modifier=".cg")
    for _ in tl.static_range(DEPTH - 1):
        i = tl.load(src_ptr + i, cache_modifier=".cg")
    tl.store(dst_ptr + pid, i)


@triton.jit
def _barriers_kernel(sync_ptr, BARRIERS: tl.constexpr):
    nprog = tl.num_programs(0)
    for b in range(BARRIERS):
        _grid_sync(sync_ptr, (b + 1) * nprog)
    _grid_exit(sync_ptr)


@dataclass(frozen=True)
class Hop:
    """µs per kernel of a chain of ``HOPS`` dependent kernels."""

    programs: int
    depth: int
    pdl: bool
    us_per_kernel: float


@dataclass(frozen=True)
class Barrier:
    """µs per grid barrier of one launch of ``programs`` programs."""

    programs: int
    us_per_barrier: float
    launch_us: float


def hop_chain_us(programs: int, depth: int, pdl: bool, device: torch.device) -> float:
    """µs per kernel of ``HOPS`` dependent hop kernels in one graph."""
    a = torch.arange(programs, dtype=torch.int32, device=device)
    b = a.clone()

    def chain() -> None:
        for h in range(HOPS):
            src, dst = (a, b) if h % 2 == 0 else (b, a)
            _hop_kernel[(programs,)](
                src, dst, DEPTH=depth, USE_PDL=pdl, num_warps=1, launch_pdl=pdl
            )

    chain()  # compiled before capture
    return graph_call_us(chain, calls=1, replays=20) / HOPS


def barrier_us(programs: int, device: torch.device) -> Barrier:
    """µs per barrier: a launch of ``HOPS`` barriers less a launch of none."""
    sync = torch.zeros(2, dtype=torch.int32, device=device)

    def run(barriers: int) -> float:
        def once() -> None:
            _barriers_kernel[(programs,)](sync, BARRIERS=barriers, num_warps=4)

        once()
        return graph_call_us(once, calls=10, replays=10)

    empty = run(0)
    return Barrier(programs, (run(HOPS) - empty) / HOPS, empty)


@dataclass(frozen=True)
class Attention:
    """µs per decode attention call (the kernel and its split merge)."""

    shape: str
    batch: int
    us: float


def attention_us(shape: str, batch: int, device: torch.device) -> Attention:
    """``batch`` decode tokens' attention at KV length 512, as the engine launches it."""
    hf = model_config(SMOLLM2_CONFIG if shape == "smollm2" else shape)
    case = Case(ModelConfig.from_hf(hf), batch, 512, torch.bfloat16, device)

    def call() -> None:
        paged_attention(
            case.q, case.k_cache, case.v_cache, case.positions, case.token_req, case.pages,
            case.scale, out=case.out, rope=case.rope, pdl=True,
        )  # fmt: skip

    call()
    return Attention(shape, batch, graph_call_us(call, calls=30, replays=20))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = num_sms(device)
    hops = [
        Hop(programs, depth, pdl, hop_chain_us(programs, depth, pdl, device))
        for pdl in (True, False)
        for programs in (1, sms)
        for depth in (1, 4, 16)
    ]
    for h in hops:
        print(f"hop: {h.programs:4d} programs depth {h.depth:2d} pdl {h.pdl!s:5s} "
              f"{h.us_per_kernel:6.2f} us/kernel")  # fmt: skip
    barriers = [barrier_us(p, device) for p in (sms // 2, sms)]
    for b in barriers:
        print(f"barrier: {b.programs:4d} programs {b.us_per_barrier:6.2f} us/barrier "
              f"(launch {b.launch_us:.2f} us)")  # fmt: skip
    attention = [attention_us(s, b, device) for s in ("smollm2", "llama-1.5b") for b in (1, 8)]
    for a in attention:
        print(f"attention: {a.shape} B={a.batch}: {a.us:.2f} us")
    doc = {
        "benchmark": "latency_floor",
        "provenance": asdict(Provenance.collect()),
        "triton": triton.__version__,
        "sms": sms,
        "hops_per_chain": HOPS,
        "hops": [asdict(h) for h in hops],
        "barriers": [asdict(b) for b in barriers],
        "attention": [asdict(a) for a in attention],
    }
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
