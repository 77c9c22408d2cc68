"""Prefill time through the public API only: ``LLM.generate`` of B prompts of L random
token ids, one new token each, so the call is the prompts' prefill (one step: the token
budget holds every case) and the host around it. It imports nothing of the library but
``LLM``, ``SamplingParams`` and ``Provenance``, so an older checkout's library can be put
on the path and timed by the same script::

    python -m benchmarks.prefill --label new --out new.json
    PYTHONPATH=<old checkout>/src:. python -m benchmarks.prefill --label old --out old.json

Each case: two untimed calls, then the median of ``--repeats`` timed calls (each ended
by a device synchronize), ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import DEFAULT_SHAPE
from benchmarks.ready import ready
from ostinato.engine import LLM, SamplingParams
from ostinato.provenance import Provenance


@dataclass(frozen=True)
class PrefillTiming:
    batch: int
    prompt_len: int
    ms: float  # median of the timed calls
    tokens_per_s: float
    times_ms: list[float]  # every timed call, in order


def _cases(text: str) -> list[tuple[int, int]]:
    """``"1x512,8x512"`` as [(1, 512), (8, 512)] (batch x prompt length)."""
    cases = []
    for item in text.split(","):
        b, _, length = item.partition("x")
        if not (b.isdigit() and length.isdigit()) or int(b) < 1 or int(length) < 1:
            raise ValueError(f"--cases: expected BxL items such as 1x512, got {item!r}")
        cases.append((int(b), int(length)))
    return cases


def time_case(llm: LLM, batch: int, length: int, repeats: int, seed: int) -> PrefillTiming:
    """The median ms of ``generate`` over ``batch`` random prompts of ``length`` tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = llm.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, length), generator=g).tolist()
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times = []
    for i in range(repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        if i >= 2:  # the first two calls warm up
            times.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times)
    return PrefillTiming(batch, length, ms, batch * length / ms * 1e3, times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--label", default="", help="which library was timed (recorded)")
    parser.add_argument("--shape", default=DEFAULT_SHAPE)
    parser.add_argument("--cases", default="1x512,1x2048,8x512,4x2048")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cases = _cases(args.cases)
    tokens = max(b * n for b, n in cases)
    llm = LLM(
        args.shape,
        dtype="bfloat16",
        max_num_seqs=max(b for b, _ in cases),
        max_model_len=max(n for _, n in cases) + 16,
        max_num_batched_tokens=tokens,
        progress=False,
    )
    ready(llm)
    rows = [time_case(llm, b, n, args.repeats, args.seed) for b, n in cases]
    for r in rows:
        rate = f"{r.tokens_per_s:.0f} tok/s"
        print(f"{args.label} B={r.batch} L={r.prompt_len}: {r.ms:.2f} ms, {rate}")
    doc = {
        "benchmark": "prefill",
        "label": args.label,
        "shape": args.shape,
        "mode": llm.mode.name,
        "repeats": args.repeats,
        "provenance": asdict(Provenance.collect()),
        "rows": [asdict(r) for r in rows],
    }
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
