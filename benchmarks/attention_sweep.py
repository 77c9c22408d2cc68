"""The paged-attention kernel's time over launch configurations (CUDA).

    python -m benchmarks.attention_sweep --out OUT/attention_sweep.json [--shape llama-1.5b]
        [--batch-sizes 8,32,128] [--kv-lens 256,512] [--prefill-lens 512,2048]

For each batch size B and KV length L (B decode tokens, one per request, each attending
L + 1 cached keys, RoPE applied in the kernel as the engine does), and for each prefill
length P (one request's P tokens, causal): the time of one ``paged_attention`` call
(with its split merge) for every split count, keys per iteration, warps and pipeline
stages in the grid, and the default choice's time. Each time is device time per call of
a CUDA graph of back-to-back calls (``graph_call_us``; PDL-launched where the engine
launches so), with the share of the copy bandwidth that the KV bytes read would take.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.decode import copy_bandwidth_gbps
from ostinato.engine.kernels.attention_launch import AttentionLaunch
from ostinato.engine.kernels.options import KernelOptions
from ostinato.engine.kernels.paged_attention import num_splits, paged_attention
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.presets import SHAPES
from ostinato.platform.cuda import graph_call_us
from ostinato.provenance import Provenance

BLOCK = 16
CALLS = 20  # calls per timed graph


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
    """B decode tokens, one per request, each at position ``kv_len`` over scattered pages;
    with ``prefill``, one request's ``kv_len`` tokens at positions ``0..kv_len`` (``b`` is
    then 0 in the timings)."""

    def __init__(
        self,
        config: ModelConfig,
        b: int,
        kv_len: int,
        dtype: torch.dtype,
        device: torch.device,
        prefill: bool = False,
    ) -> None:
        heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
        requests, tokens = (1, kv_len) if prefill else (b, b)
        per_seq = (kv_len + 1 + BLOCK - 1) // BLOCK
        # Each request's pages are scattered over the cache, as after some churn.
        self.pages = torch.randperm(requests * per_seq, device=device).view(requests, -1) + 1
        cache_shape = (requests * per_seq + 1, BLOCK, kv_heads, d)
        self.k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
        self.v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype, device=device)
        self.q = qkv[:, : heads * d].view(tokens, heads, d)  # a strided view, as in the model
        angles = torch.rand(tokens, 1, d, device=device)
        self.rope = (angles.cos().to(dtype), angles.sin().to(dtype))
        if prefill:
            self.positions = torch.arange(tokens, dtype=torch.int64, device=device)
            self.token_req = torch.zeros(tokens, dtype=torch.int32, device=device)
        else:
            self.positions = torch.full((b,), kv_len, dtype=torch.int64, device=device)
            self.token_req = torch.arange(b, dtype=torch.int32, device=device)
        self.out = torch.empty_like(self.q)
        self.b, self.kv_len, self.scale = (0 if prefill else b), kv_len, d**-0.5
        self.kv_bytes = 2 * requests * (kv_len + 1) * kv_heads * d * dtype.itemsize
        # Where the device has PDL, as the engine's default options resolve it (pdl_for
        # then keeps it to the row counts that take it).
        self.pdl = KernelOptions().resolved(device).pdl

    def timing(
        self, splits: int, launch: AttentionLaunch | None, bandwidth_gbps: float
    ) -> Timing | None:
        """One configuration's time (None where Triton cannot build it)."""

        def call() -> None:
            paged_attention(
                self.q, self.k_cache, self.v_cache, self.positions, self.token_req,
                self.pages, self.scale, splits=splits, out=self.out, rope=self.rope,
                pdl=self.pdl, config=launch,
            )  # fmt: skip

        try:
            call()  # compiles this configuration outside the timing
            us = graph_call_us(call, CALLS)
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
    parser.add_argument("--prefill-lens", default="")
    parser.add_argument("--splits", default="1,2,4,8")
    parser.add_argument("--block-n", default="32,64,128")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--stages", default="1,2,3,4")
    args = parser.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    device = torch.device("cuda")
    config = ModelConfig.from_hf(SHAPES[args.shape])
    kv_heads = config.num_kv_heads
    dtype = torch.bfloat16
    bandwidth = copy_bandwidth_gbps(device)
    sweep = Sweep(args.shape, bandwidth, Provenance.collect())
    cases = [
        (b, n, False) for b, n in itertools.product(ints(args.batch_sizes), ints(args.kv_lens))
    ]
    cases += [(0, n, True) for n in ints(args.prefill_lens or "")]
    for b, kv_len, prefill in cases:
        case = Case(config, b, kv_len, dtype, device, prefill)
        tokens = kv_len if prefill else b
        rows = [case.timing(num_splits(tokens, kv_heads, device), None, bandwidth)]
        for splits, bn, w, st in itertools.product(
            ints(args.splits), ints(args.block_n), ints(args.warps), ints(args.stages)
        ):
            rows.append(case.timing(splits, AttentionLaunch(bn, w, st), bandwidth))
        rows = [t for t in rows if t is not None]
        sweep.timings.extend(rows)
        best = min(rows, key=lambda t: t.us)
        base = rows[0]
        print(
            f"{'prefill' if prefill else f'B={b}'} L={kv_len}: default {base.us:.1f} us "
            f"(splits {base.splits}), best "
            f"{best.us:.1f} us (splits {best.splits}, block_n {best.block_n}, warps "
            f"{best.num_warps}, stages {best.num_stages}; {best.bandwidth_share:.0%} of copy "
            "bandwidth)",
            flush=True,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(asdict(sweep), indent=1) + "\n")  # case by case


if __name__ == "__main__":
    main()
