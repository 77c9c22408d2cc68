"""Request mixes shared by the CPU and GPU engine tests."""

from __future__ import annotations

import random
from collections.abc import Callable

from ostinato.engine import LLM, SamplingParams


def preempting_mix(seed: int = 5) -> tuple[list[list[int]], list[SamplingParams]]:
    """12 random prompts of 1 to 60 tokens, 1 to 40 new tokens each and 30 random stop
    tokens: with 9 usable KV blocks of 16 for 8 sequences, requests get preempted."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(1, 60))] for _ in range(12)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 40),
            ignore_eos=True,
            stop_token_ids=tuple(rng.sample(range(1, 1000), 30)),
        )
        for _ in prompts
    ]
    return prompts, params


def sync_and_async_outputs(make: Callable[[bool], LLM]) -> dict[bool, list[tuple]]:
    """``preempting_mix`` through ``make(async_scheduling)`` engines (10 KV blocks) both
    ways: each run's (tokens, finish reason) per request, keyed by async_scheduling.
    Asserts that requests were preempted and every block came back."""
    prompts, params = preempting_mix()
    outs = {}
    for asyn in (False, True):
        llm = make(asyn)
        outs[asyn] = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
        assert llm.scheduler.num_preemptions > 0
        assert llm.scheduler.pool.num_free == 9
    return outs
