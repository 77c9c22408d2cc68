"""Whether the norm's sums of squares should come from the projection before it: a
decoder layer's four Triton GEMM kernels (norm+QKV+RoPE+K/V write, O, norm+gate/up+
SiLU·mul, down; attention left out) chained over enough layers of distinct weights to
read them from DRAM, captured as one graph of PDL launches, in three hand-overs:

- ``prologue``: each norm's programs sum their rows' squares before their K loop (the
  library's default);
- ``stats``: O and down store the row statistics of their output plus the residual
  (``ResidualStats``), and the norms take them (``NormPrologue.stats``), still adding
  the residual themselves;
- ``stream``: O and down also store that sum (the residual stream), so the norms read
  one tensor, not two.

``python -m benchmarks.row_stats --out results.json [--rows 1,8,16] [--shapes smollm2]``
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.fused_sweep import SHAPES
from ostinato.platform.cuda import graph_call_us
from ostinato.provenance import Provenance

HANDOVERS = ("prologue", "stats", "stream")
CHAIN_BYTES = 160 * 2**20  # weights a chain reads: more than the L2 cache holds
EPS = 1e-5


@dataclass(frozen=True)
class Timing:
    """µs per layer of one hand-over at one shape and row count."""

    shape: str
    rows: int
    handover: str
    us_per_layer: float


@dataclass
class _Layer:
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def _chain(name: str, rows: int, handover: str, layers: list[_Layer]) -> Callable[[], None]:
    """One call runs every layer's four kernels under ``handover``."""
    from ostinato.engine.kernels import small_gemm as tg
    from ostinato.engine.kernels.gemm_launch import (
        GemmConfig,
        k_step,
        pick_config,
        rope_split_k,
    )
    from ostinato.engine.kernels.launch import num_sms

    hidden, heads, kv_heads, d, inter = SHAPES[name]
    dev = torch.device("cuda")
    sms = num_sms(dev)
    bf = dict(device=dev, dtype=torch.bfloat16)
    split = rope_split_k(heads + 2 * kv_heads, hidden, sms)
    qkv_cfg = GemmConfig(d // 2, split, block_k=k_step(hidden, split))
    o_cfg = tg.CONFIGS[pick_config(hidden, heads * d, sms) - 1]
    gu_cfg = tg.CONFIGS[pick_config(inter, hidden, sms, swiglu=True) - 1]
    down_cfg = tg.CONFIGS[pick_config(hidden, inter, sms) - 1]
    counters = torch.zeros(4096, dtype=torch.int32, device=dev)
    cache = torch.zeros(64, 16, kv_heads, d, **bf)
    cos = torch.ones(rows, 1, d, **bf)
    slots = torch.arange(rows, device=dev) + 16
    rope = tg.RopeKV(cos, cos, cache, cache.clone(), slots, heads, kv_heads)
    norm_w = torch.ones(hidden, **bf)
    x = torch.randn(rows, hidden, **bf)
    res = torch.randn(rows, hidden, **bf)
    stats = [torch.zeros(tg.MAX_ROWS, tg.stats_columns(hidden), device=dev) for _ in range(2)]
    q = torch.empty(rows, heads * d, **bf)

    def run() -> None:
        h, r, s_in = x, res, None
        for layer in layers:
            add = handover != "stream"
            total = torch.empty_like(h)
            norm = tg.NormPrologue(norm_w, EPS, r if add else None, total if add else None, s_in)
            tg.qkv_rope_kv(h, layer.qkv, None, counters, qkv_cfg, rope, norm, True, out=q)
            r = total if add else h
            after = None if handover == "prologue" else tg.ResidualStats(r, stats[0], not add)
            h = tg.small_gemm(q, layer.o, None, counters, o_cfg, False, True, None, after)
            s_in = stats[0] if after else None
            total = torch.empty_like(h)
            norm = tg.NormPrologue(norm_w, EPS, r if add else None, total if add else None, s_in)
            act = tg.small_gemm(h, layer.gate_up, None, counters, gu_cfg, True, True, norm)
            r = total if add else h
            after = None if handover == "prologue" else tg.ResidualStats(r, stats[1], not add)
            h = tg.small_gemm(act, layer.down, None, counters, down_cfg, False, True, None, after)
            s_in = stats[1] if after else None

    return run


def measure(name: str, rows: int) -> list[Timing]:
    """Every hand-over at one shape and row count, on the same weights."""
    hidden, heads, kv_heads, d, inter = SHAPES[name]
    bf = dict(device="cuda", dtype=torch.bfloat16)

    def layer() -> _Layer:
        return _Layer(
            torch.randn((heads + 2 * kv_heads) * d, hidden, **bf) / 30,
            torch.randn(hidden, heads * d, **bf) / 30,
            torch.randn(2 * inter, hidden, **bf) / 30,
            torch.randn(hidden, inter, **bf) / 30,
        )

    one = layer()
    per_layer = sum(t.nbytes for t in (one.qkv, one.o, one.gate_up, one.down))
    layers = [one] + [layer() for _ in range(max(1, CHAIN_BYTES // per_layer) - 1)]
    out = []
    for handover in HANDOVERS + HANDOVERS[:1]:  # the first again: drift shows as A vs A
        run = _chain(name, rows, handover, layers)
        run()  # compiles outside the capture
        us = graph_call_us(run, 2, replays=10) / len(layers)
        out.append(Timing(name, rows, handover, us))
        print(f"{name:10s} rows {rows:2d} {handover:8s} {us:6.2f} us/layer", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    timings = []
    for name in args.shapes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            timings += measure(name, rows)
    doc = {"provenance": asdict(Provenance.collect()), "timings": [asdict(t) for t in timings]}
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
