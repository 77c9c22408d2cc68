"""Where a ``generate`` token's time goes on the host, phase by phase, and what a call
costs besides its tokens: one request at B = 1 (SmolLM2-135M-Instruct from its GGUF, or
random weights of a preset shape), bf16, FULL_AND_PIECEWISE, asynchronous scheduling.

- ``ms_per_token``: the wall time of ``generate`` for 128 and for 256 new tokens over
  their count, after a warm-up call of the same length (median of ``--repeats``).
- ``fixed_ms``: what a call costs besides its tokens, from those two: the intercept of
  the line through them (prefill, request set-up, the last copy back).
- ``one_token_ms``: a call for one new token (the prompt's prefill and the set-up), and
  ``one_token_profile``: the top of its cProfile by cumulative time.
- ``phases``: host µs per step of each timed engine method (a wrapper around each adds
  about 1 µs; nested phases are included in their callers'). ``wait_copy`` is the host
  waiting for the device: near zero means the host sets the pace.

``python -m benchmarks.generate_phases --out results.json [--model gguf|smollm2|llama-1.5b]``
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.decode import SMOLLM2_CONFIG, model_config
from benchmarks.generate_profile import generate_seconds
from ostinato.engine import LLM, Engine
from ostinato.provenance import Provenance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from smollm2 import PROMPTS  # noqa: E402

# (the part of an ``Engine`` that owns it, method): the host phases of a step,
# outermost first.
PHASES: tuple[tuple[str, str], ...] = (
    ("loop", "launch"),
    ("loop", "resolve"),
    ("loop", "wait_copy"),
    ("loop", "copy_back"),
    ("scheduler", "schedule"),
    ("scheduler", "launched"),
    ("scheduler", "resolve"),
    ("runner", "execute"),
    ("runner.inputs", "write"),
    ("runner.inputs", "copy_staged"),
    ("runner.inputs", "take_previous"),
    ("runner.manager", "run"),
    ("sampler", "tokens"),
)


@dataclass
class Phase:
    calls: int = 0
    ns: int = 0


@dataclass
class Result:
    model: str
    ms_per_token: dict[int, float]
    fixed_ms: float
    one_token_ms: float
    one_token_profile: str
    steps: int
    phases_us_per_step: dict[str, float] = field(default_factory=dict)
    calls_per_step: dict[str, float] = field(default_factory=dict)


def _timed(method: Callable[..., Any], phase: Phase) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return method(*args, **kwargs)
        finally:
            phase.ns += time.perf_counter_ns() - start
            phase.calls += 1

    return wrapper


def _owner(engine: Engine, path: str) -> type:
    part: Any = engine
    for attr in path.split("."):
        part = getattr(part, attr)
    return type(part)


@contextlib.contextmanager
def timed_phases(engine: Engine) -> Iterator[dict[str, Phase]]:
    """Every method of ``PHASES`` timed while inside (totals by ``Owner.method``)."""
    owners = [(_owner(engine, path), name) for path, name in PHASES]
    phases = {f"{owner.__name__}.{name}": Phase() for owner, name in owners}
    with contextlib.ExitStack() as stack:
        for owner, name in owners:
            wrapped = _timed(getattr(owner, name), phases[f"{owner.__name__}.{name}"])
            stack.enter_context(mock.patch.object(owner, name, wrapped))
        yield phases


def _llm(model: str) -> LLM:
    common = dict(dtype="bfloat16", mode="full_and_piecewise", progress=False)
    if model == "gguf":  # as benchmarks.smollm2_generate builds it
        return LLM(max_model_len=512, max_num_seqs=8, **common)
    config = model_config(SMOLLM2_CONFIG if model == "smollm2" else model)
    return LLM(config, random_weights=True, device="cuda", **common)


def measure(model: str, repeats: int) -> Result:
    llm = _llm(model)
    prompt = llm.tokenizer.encode(PROMPTS[0]) if model == "gguf" else list(range(1, 21))
    seconds: dict[int, float] = {}
    for tokens in (128, 256):
        generate_seconds(llm, prompt, tokens)  # warm-up of the same length
        runs = [generate_seconds(llm, prompt, tokens) for _ in range(repeats)]
        seconds[tokens] = statistics.median(runs)
    slope = (seconds[256] - seconds[128]) / 128
    generate_seconds(llm, prompt, 1)
    one = statistics.median(generate_seconds(llm, prompt, 1) for _ in range(repeats))
    prof = cProfile.Profile()
    prof.runcall(generate_seconds, llm, prompt, 1)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    result = Result(
        model,
        {t: 1e3 * s / t for t, s in seconds.items()},
        1e3 * (seconds[128] - 128 * slope),
        1e3 * one,
        text.getvalue(),
        256,
    )
    with timed_phases(llm.engine) as phases:
        generate_seconds(llm, prompt, 256)
    for name, phase in phases.items():
        result.phases_us_per_step[name] = phase.ns / 1e3 / result.steps
        result.calls_per_step[name] = phase.calls / result.steps
    del llm
    torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="gguf", choices=("gguf", "smollm2", "llama-1.5b"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = measure(args.model, args.repeats)
    doc = {
        "benchmark": "generate_phases",
        "provenance": asdict(Provenance.collect()),
        "result": asdict(result),
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in asdict(result).items() if k != "one_token_profile"}))
    print(result.one_token_profile[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
