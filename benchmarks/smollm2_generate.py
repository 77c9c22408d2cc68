"""Tokens/s of ``LLM.generate`` on SmolLM2-135M-Instruct in each graph mode.

B prompts (distinct text, ~20 tokens each), 128 new tokens each, greedy, EOS ignored;
the wall time of ``generate`` after one warm-up call. Also checks that every mode's
greedy tokens equal eager's. Writes JSON (device, torch, commit, date) with ``--out``.

Usage: python -m benchmarks.smollm2_generate --out results.json [--batch-sizes 1,32]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from smollm2 import PROMPTS  # noqa: E402

from benchmarks.ready import ready
from ostinato.engine import LLM, SamplingParams  # noqa: E402

MODES = ("none", "full", "full_decode_only", "full_and_piecewise")


@dataclass
class Row:
    dtype: str
    mode: str
    batch: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    ms_per_step: float
    startup_s: float
    graphs: int
    same_tokens_as_eager: bool


def prompts_for(llm: LLM, batch: int) -> list[list[int]]:
    base = [llm.tokenizer.encode(p) for p in PROMPTS]
    return [base[i % len(base)] + llm.tokenizer.encode(f" (variant {i})") for i in range(batch)]


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def main() -> int:
    args = _args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    rows: list[Row] = []
    eager_tokens: dict[tuple[str, int], list[list[int]]] = {}
    for dtype, mode in [(d, m) for d in args.dtypes.split(",") for m in args.modes.split(",")]:
        llm = LLM(
            mode=mode, dtype=dtype, max_model_len=512, max_num_seqs=max(sizes), progress=False
        )
        ready(llm)
        for b in sizes:
            prompts = prompts_for(llm, b)
            llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            tokens = [o.token_ids for o in outs]
            if mode == "none":
                eager_tokens[(dtype, b)] = tokens
            row = Row(
                dtype,
                llm.mode.name,
                b,
                args.new_tokens,
                seconds,
                b * args.new_tokens / seconds,
                1e3 * seconds / args.new_tokens,
                llm.startup_seconds,
                llm.capture_report.num_graphs,
                tokens == eager_tokens.get((dtype, b)),
            )
            rows.append(row)
            print(
                f"{dtype:9s} {row.mode:20s} B={b:3d} {row.tokens_per_s:9.1f} tok/s "
                f"{row.ms_per_step:7.2f} ms/step start-up {row.startup_s:5.1f} s "
                f"graphs {row.graphs:3d} same as eager: {row.same_tokens_as_eager}",
                flush=True,
            )
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    document = {
        "benchmark": "smollm2_generate",
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to each row's dtype)",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": os.environ.get("OSTINATO_COMMIT", "unknown"),
        "date": time.strftime("%Y-%m-%d"),
        "setup": f"B text prompts, {args.new_tokens} new tokens each, greedy, EOS ignored; "
        "wall time of generate after a warm-up call",
        "rows": [asdict(r) for r in rows],
    }
    if args.out:
        args.out.write_text(json.dumps(document, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
