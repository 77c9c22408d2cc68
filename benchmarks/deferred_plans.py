"""Decode speed through a first start whose kernel plans are deferred: rounds of greedy
``generate`` from the moment the engine returns (its graphs captured in the background,
the rules' plans, then the measurement and the swap) until the measurement has ended and
a few rounds after; then the same rounds on an engine that read the measured plans from
the cache (a later start).

    python -m benchmarks.deferred_plans --out OUT.json [--model llama-1.5b] [--batch 8]

Each round is ``--batch`` prompts of ``--prompt-len`` random tokens and ``--new-tokens``
new ones (EOS ignored); its tokens per second count the new tokens over the round's wall
time, and its longest gap is the longest wait between two tokens of its first prompt (a
step held back by the background work shows there, where the round's mean hides it);
its first token's wait shows a held prefill step, which no gap between two tokens does.
Both engines use one fresh cache folder, so the first start measures its plans. Back to
back, the rounds leave the background work only the turns ``ostinato.background`` paces
(steps come first); on an H200 the 1.5 B shape's first start had not settled after 140 s
of rounds at B = 8.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import logging
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ostinato.engine import LLM, SamplingParams
from ostinato.provenance import Provenance


@dataclass
class Round:
    """One timed ``generate``: seconds since the engine returned, tokens per second,
    whether the background work (capture, measurement, swap) had ended before it, the
    longest wait between two tokens of its first prompt (a step's time, with whatever
    held it back: what a streamed client sees), and when that wait ended, on the clock
    of the engine's log lines (to place it among the background work's phases); and the
    wait for its first prompt's first token (its prefill step, with whatever held that
    back, which no gap between two tokens shows; the first round's includes the first
    step's kernels)."""

    since_start_s: float
    tokens_per_s: float
    settled: bool
    longest_gap_ms: float
    longest_gap_ended: str = ""
    first_token_ms: float = 0.0


def _rounds(llm: LLM, args: argparse.Namespace, until_settled: bool, name: str) -> list[Round]:
    """Rounds until ``--rounds-after`` of them ran settled (``until_settled``), or that many
    rounds; or until ``--timeout`` seconds, the last round then unsettled. Each printed
    as it ends."""
    rng = random.Random(0)
    vocab = llm.config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    start, rounds, after = time.perf_counter(), [], 0
    while after < args.rounds_after:
        settled = llm.background is None or llm.background.done
        stamps: list[tuple[float, float]] = []
        began = time.perf_counter()
        outs = llm.generate(prompts, params, on_token=functools.partial(_stamp, stamps))
        seconds = time.perf_counter() - began
        tokens = sum(len(o.token_ids) for o in outs)
        gap, ended = _longest_gap(stamps)
        first = (stamps[0][0] - began) * 1e3 if stamps else 0.0
        rounds.append(Round(began - start, tokens / seconds, settled, gap, ended, first))
        clock = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]  # (as the log lines')
        print(
            f"{clock} {name}: +{began - start:6.2f} s {tokens / seconds:8.1f} tok/s "
            f"longest gap {gap:6.2f} ms first token {first:7.2f} ms",
            settled,
            flush=True,
        )
        after += settled or not until_settled
        if time.perf_counter() - start > args.timeout:
            break  # (the background work outlasted --timeout: the document says so)
    return rounds


def _stamp(stamps: list[tuple[float, float]], prompt: int, token: int) -> None:
    if prompt == 0:  # (every prompt's tokens come in the same steps)
        stamps.append((time.perf_counter(), time.time()))


def _longest_gap(stamps: list[tuple[float, float]]) -> tuple[float, str]:
    """The longest wait between two stamps (ms) and the wall clock it ended at, as the
    log lines print it ("" with fewer than two stamps)."""
    pairs = list(itertools.pairwise(stamps))
    if not pairs:
        return 0.0, ""
    (a, _), (b, wall) = max(pairs, key=lambda p: p[1][0] - p[0][0])
    clock = datetime.datetime.fromtimestamp(wall).strftime("%H:%M:%S.%f")[:-3]
    return (b - a) * 1e3, clock


def longest_gaps_ms(rounds: list[Round]) -> dict[str, float | None]:
    """The longest wait between two tokens over the rounds run before the background
    work had ended and over those after (None where there were none)."""
    return _longest_by_settled(rounds, lambda r: r.longest_gap_ms)


def longest_first_tokens_ms(rounds: list[Round]) -> dict[str, float | None]:
    """The longest wait for a round's first token, the first round left out (its first
    step compiles its kernels), over the rounds before the background work had ended and
    over those after (None where there were none)."""
    return _longest_by_settled(rounds[1:], lambda r: r.first_token_ms)


def _longest_by_settled(
    rounds: list[Round], value: Callable[[Round], float]
) -> dict[str, float | None]:
    during = [value(r) for r in rounds if not r.settled]
    after = [value(r) for r in rounds if r.settled]
    return {"during": max(during, default=None), "after": max(after, default=None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="llama-1.5b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds-after", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    # The engine's phases (capture, measurement) on the rounds' clock, to place stalls.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s.%(msecs)03d %(message)s", datefmt="%H:%M:%S"
    )
    cache = tempfile.mkdtemp(prefix="ostinato-deferred-")
    kw = dict(max_model_len=256, max_num_seqs=max(8, args.batch), progress=False)
    first = LLM(args.model, cache_dir=cache, capture="auto", **kw)
    deferred = first.startup.plans_deferred
    during = _rounds(first, args, True, "first start")
    described = first.describe()
    background = first.background
    # Read after close, which waits for a measurement still running (past --timeout, the
    # rounds end before it does, and its last units would be missing).
    first.close()
    hold = background.longest_hold if background is not None else None
    holds = {k: asdict(v) for k, v in background.holds.items()} if background is not None else {}
    background_s = background.seconds if background is not None else None
    later = LLM(args.model, cache_dir=cache, capture="blocking", **kw)
    after = _rounds(later, args, False, "later start")
    doc = {
        "provenance": asdict(Provenance.collect()),
        "args": {k: str(v) for k, v in vars(args).items()},
        "first_start_deferred": deferred,
        "first_start": [asdict(r) for r in during],
        "first_start_described": described,
        # The longest a step could wait for the capture thread, and what held it.
        "first_start_longest_hold": asdict(hold) if hold is not None else None,
        # Every hold by kind (the captures, the epilogue, each unit's function).
        "first_start_holds": holds,
        # How long the thread ran, capture and measurement (None: a blocking start).
        "first_start_background_s": background_s,
        "later_start": [asdict(r) for r in after],
        # What a streamed client waits between two tokens at worst: during the first
        # start's background work and after it; then the later start's.
        "first_start_longest_gaps_ms": longest_gaps_ms(during),
        "later_start_longest_gap_ms": longest_gaps_ms(after)["after"],
        # A held prefill step: what a new request waits beyond its prefill at worst.
        "first_start_longest_first_token_ms": longest_first_tokens_ms(during),
    }
    later.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
