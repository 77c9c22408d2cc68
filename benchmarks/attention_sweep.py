"""The paged-attention kernel's decode time over launch configurations (CUDA).

    python -m benchmarks.attention_sweep --out OUT/attention_sweep.json [--shape llama-1.5b]
        [--batch-sizes 8,32,128] [--kv-lens 256,512]

For each batch size B and KV length L (B decode tokens, one per request, each attending
L + 1 cached keys, RoPE applied in the kernel as the engine does): the time of one
``paged_attention`` call (with its split merge) for every split count, keys per
iteration, warps and pipeline stages in the grid, and the default choice's time. Each
time is ``bench.decode.pipelined_ms``'s (the median over rounds of back-to-back
launches), with the share of the copy bandwidth that the KV bytes read would take.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.decode import copy_bandwidth_gbps, pipelined_ms
from ostinato.engine.kernels.attention_launch import AttentionLaunch
from ostinato.engine.kernels.paged_attention import num_splits, paged_attention
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.presets import SHAPES
from ostinato.provenance import Provenance

BLOCK = 16


@dataclass
class Timing:
    batch: int
    kv_len: int
    splits: int
    block_n: int
    num_warps: int
    num_stages: int
    us: float
    bandwidth_share: float
    default: bool


@dataclass
class Sweep:
    shape: str
    copy_bandwidth_gbps: float
    provenance: Provenance  # device, torch, commit, date
    timings: list[Timing] = field(default_factory=list)


class Case:
    """B decode tokens, one per request, each at position ``kv_len`` over scattered pages."""

    def __init__(
        self, config: ModelConfig, b: int, kv_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
        per_seq = (kv_len + 1 + BLOCK - 1) // BLOCK
        # Each request's pages are scattered over the cache, as after some churn.
        self.pages = torch.randperm(b * per_seq, device=device).view(b, per_seq) + 1
        cache_shape = (b * per_seq + 1, BLOCK, kv_heads, d)
        self.k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
        self.v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
        qkv = torch.randn(b, (heads + 2 * kv_heads) * d, dtype=dtype, device=device)
        self.q = qkv[:, : heads * d].view(b, heads, d)  # a strided view, as in the model
        angles = torch.rand(b, 1, d, device=device)
        self.rope = (angles.cos().to(dtype), angles.sin().to(dtype))
        self.positions = torch.full((b,), kv_len, dtype=torch.int64, device=device)
        self.token_req = torch.arange(b, dtype=torch.int32, device=device)
        self.out = torch.empty_like(self.q)
        self.b, self.kv_len, self.scale = b, kv_len, d**-0.5
        self.kv_bytes = 2 * b * (kv_len + 1) * kv_heads * d * dtype.itemsize

    def timing(
        self, splits: int, launch: AttentionLaunch | None, bandwidth_gbps: float
    ) -> Timing | None:
        """One configuration's time (None where Triton cannot build it)."""

        def call() -> None:
            paged_attention(
                self.q, self.k_cache, self.v_cache, self.positions, self.token_req,
                self.pages, self.scale, splits=splits, out=self.out, rope=self.rope,
                config=launch,
            )  # fmt: skip

        try:
            call()  # compiles this configuration outside the timing
            us = pipelined_ms(call, steps=50) * 1e3
        except Exception as exc:  # e.g. out of shared memory for this tile and stages
            print(f"B={self.b} L={self.kv_len} splits={splits} {launch}: {exc!r:.200}")
            return None
        chosen = launch or AttentionLaunch()
        return Timing(
            self.b, self.kv_len, splits, chosen.block_n, chosen.num_warps, chosen.num_stages,
            us, self.kv_bytes / (us * 1e-6) / (bandwidth_gbps * 1e9), launch is None,
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="llama-1.5b")
    parser.add_argument("--batch-sizes", default="8,32,128")
    parser.add_argument("--kv-lens", default="256,512")
    parser.add_argument("--splits", default="1,2,4,8")
    parser.add_argument("--block-n", default="32,64,128")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--stages", default="1,2,3,4")
    args = parser.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    device = torch.device("cuda")
    config = ModelConfig.from_hf(SHAPES[args.shape])
    kv_heads = config.num_kv_heads
    dtype = torch.bfloat16
    bandwidth = copy_bandwidth_gbps(device)
    sweep = Sweep(args.shape, bandwidth, Provenance.collect())
    for b, kv_len in itertools.product(ints(args.batch_sizes), ints(args.kv_lens)):
        case = Case(config, b, kv_len, dtype, device)
        rows = [case.timing(num_splits(b, kv_heads, device), None, bandwidth)]
        for splits, bn, w, st in itertools.product(
            ints(args.splits), ints(args.block_n), ints(args.warps), ints(args.stages)
        ):
            rows.append(case.timing(splits, AttentionLaunch(bn, w, st), bandwidth))
        rows = [t for t in rows if t is not None]
        sweep.timings.extend(rows)
        best = min(rows, key=lambda t: t.us)
        base = rows[0]
        print(
            f"B={b} L={kv_len}: default {base.us:.1f} us (splits {base.splits}), best "
            f"{best.us:.1f} us (splits {best.splits}, block_n {best.block_n}, warps "
            f"{best.num_warps}, stages {best.num_stages}; {best.bandwidth_share:.0%} of copy "
            "bandwidth)",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(sweep), indent=1) + "\n")


if __name__ == "__main__":
    main()
