"""Request mixes shared by the CPU and GPU engine tests."""

from __future__ import annotations

import random
from collections.abc import Callable

from ostinato.engine import LLM, SamplingParams


def random_mix(
    seed: int, n: int, max_prompt: int, max_new: int, vocab: int, stops: int
) -> tuple[list[list[int]], list[SamplingParams]]:
    """``n`` random prompts of 1 to ``max_prompt`` tokens below ``vocab``, 1 to
    ``max_new`` new tokens each, EOS ignored, and ``stops`` random stop tokens (some
    requests stop early)."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(1, vocab) for _ in range(rng.randint(1, max_prompt))] for _ in range(n)
    ]
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, max_new),
            ignore_eos=True,
            stop_token_ids=tuple(rng.sample(range(1, vocab), stops)),
        )
        for _ in prompts
    ]
    return prompts, params


def preempting_mix(seed: int = 5) -> tuple[list[list[int]], list[SamplingParams]]:
    """12 requests of up to 60 + 40 tokens: with 9 usable KV blocks of 16 for 8
    sequences, requests get preempted."""
    return random_mix(seed, 12, 60, 40, 1000, 30)


def sync_and_async_outputs(make: Callable[[bool], LLM]) -> dict[bool, list[tuple]]:
    """``preempting_mix`` through ``make(async_scheduling)`` engines (10 KV blocks) both
    ways: each run's (tokens, finish reason) per request, keyed by async_scheduling.
    Asserts that requests were preempted and every block came back."""
    prompts, params = preempting_mix()
    outs = {}
    for asyn in (False, True):
        llm = make(asyn)
        outs[asyn] = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
        assert llm.num_preemptions > 0
        assert llm.free_kv_blocks == 9
    return outs
