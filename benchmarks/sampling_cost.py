"""What each sampling parameter adds to a decode step: ``LLM.generate`` on a preset shape
(random weights), every request of a batch with one parameter set, against greedy.

    python -m benchmarks.sampling_cost --out OUT/sampling.json [--model llama-1.5b]
        [--mode auto] [--batch-sizes 1,8,64] [--repeats 3]

A step's time is the difference of two generates of the same prompts (``--long`` and
``--short`` new tokens) over the difference of their tokens, so the prefill cancels. Each
(batch size, parameter) pair is warmed, then timed ``--repeats`` times, interleaved with
greedy (A/B/A in one process); the median is reported, with its ratio to the median
greedy step of the same batch size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.ready import ready

# One entry per parameter a request can set, each with an effect, and all of them.
VARIANTS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "temperature": {"temperature": 0.8},
    "top_p": {"temperature": 0.8, "top_p": 0.95},
    "seed": {"temperature": 0.8, "seed": 1234},
    "logit_bias": {"logit_bias": {7: 0.5}},
    "presence_penalty": {"presence_penalty": 0.2},
    "frequency_penalty": {"frequency_penalty": 0.2},
    "logprobs": {"logprobs": 5},
}
VARIANTS["all"] = {k: v for d in VARIANTS.values() for k, v in d.items()}


@dataclass(frozen=True)
class Row:
    """One (batch size, variant): the median step and its ratio to greedy's."""

    batch: int
    variant: str
    step_ms: float
    vs_greedy: float
    runs_ms: list[float]


def step_ms(
    llm: Any, prompts: list[list[int]], params: Any, short: int, long: int, **generate: Any
) -> float:
    """Milliseconds per decode step: (long generate - short generate) / (long - short);
    ``generate``: more keywords of ``llm.generate``."""

    def timed(n: int) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, replace(params, max_tokens=n), **generate)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return (timed(long) - timed(short)) * 1e3 / (long - short)


def measure(llm: Any, args: argparse.Namespace) -> list[Row]:
    from ostinato.engine import SamplingParams

    base = SamplingParams(max_tokens=args.long, ignore_eos=True)
    prompt = list(range(100, 100 + args.prompt_len))
    rows = []
    for b in args.batch_sizes:
        prompts = [prompt] * b
        runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for extra in VARIANTS.values():
            step_ms(llm, prompts, replace(base, **extra), 2, 4)  # warm
        for _ in range(args.repeats):
            for name, extra in VARIANTS.items():  # greedy first in each round
                runs[name].append(
                    step_ms(llm, prompts, replace(base, **extra), args.short, args.long)
                )
        greedy = statistics.median(runs["greedy"])
        for name, times in runs.items():
            median = statistics.median(times)
            rows.append(Row(b, name, median, median / greedy, times))
            print(
                f"B={b:3d} {name:18s} {median:7.3f} ms/step  {median / greedy:5.2f}x greedy",
                flush=True,
            )
    return rows


def step_parser(doc: str, batch_sizes: str) -> argparse.ArgumentParser:
    """The options of a benchmark that times steps with ``step_ms`` (``parse`` them)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="llama-1.5b")
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--batch-sizes", default=batch_sizes)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=3)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``step_parser``'s options, checked; the batch sizes as a list."""
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if not 0 < args.short < args.long or min(args.batch_sizes) < 1 or args.repeats < 1:
        parser.error("need 0 < --short < --long, batch sizes >= 1 and --repeats >= 1")
    return args


def write_rows(args: argparse.Namespace, name: str, mode: str, rows: list, **extra: Any) -> None:
    """The benchmark's JSON at ``args.out``: provenance, the options, ``rows``."""
    from ostinato.provenance import Provenance

    doc = {
        "benchmark": name,
        "provenance": asdict(Provenance.collect()),
        "model": args.model,
        "mode": mode,
        **extra,
        "prompt_len": args.prompt_len,
        "tokens": [args.short, args.long],
        "rows": [asdict(r) for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    args = parse(step_parser(__doc__, "1,8,64"), argv)

    from ostinato.engine import LLM

    cuda = torch.cuda.is_available()
    llm = LLM(
        args.model,
        mode=args.mode,
        dtype=torch.bfloat16 if cuda else torch.float32,
        max_num_seqs=max(args.batch_sizes),
        max_model_len=args.prompt_len + args.long + 16,
        progress=False,
    )
    try:
        rows = measure(ready(llm), args)
        mode = llm.mode.name
    finally:
        llm.close()
    write_rows(args, "sampling_cost", mode, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
