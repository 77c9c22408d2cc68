"""The scheduler on its own: chunked prefill, preemption and readmission under any token
budget, abort, and the bookkeeping of blocks."""

import random

from ostinato.engine import FinishReason, SamplingParams
from ostinato.engine.core.kv_cache import BlockPool
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.scheduler import Scheduler
from ostinato.mathutil import ceil_div


def drive(sched, rng, steps=10_000):
    """Runs the scheduler with random sampled tokens until no work is left."""
    for _ in range(steps):
        if not sched.has_work:
            return
        step = sched.schedule()
        assert step.scheduled, "an empty step with work pending is a hang"
        assert step.num_tokens <= sched.max_num_batched_tokens
        for s in step.scheduled:
            r = s.request
            assert s.tokens == (r.prompt + r.output)[s.start : s.start + len(s.tokens)]
            assert len(r.blocks) * sched.block_size >= s.start + len(s.tokens)
        sched.update(step, [rng.randrange(3, 100) for _ in step.scheduled])
    raise AssertionError("did not finish")


def test_preempted_requests_longer_than_the_budget_are_readmitted():
    # Budget 8 tokens per step, 12 usable blocks of 4 tokens, requests that grow to ~40
    # tokens: preemptions happen after the prompt + output exceeds the budget.
    limits = EngineLimits(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=48, block_size=4)
    sched = Scheduler(BlockPool(13), limits)
    reqs = [
        sched.add(list(range(1, 2 + 5 * i)), SamplingParams(max_tokens=30, ignore_eos=True))
        for i in range(4)
    ]
    drive(sched, random.Random(0))
    assert sum(r.num_preemptions for r in reqs) > 0
    assert any(len(r.prompt) + 29 > 8 and r.num_preemptions for r in reqs)
    assert all(r.finished and len(r.output) == 30 for r in reqs)
    assert sched.pool.num_free == 12


def test_random_workloads_always_finish_and_return_every_block():
    rng = random.Random(1)
    for _ in range(30):
        block = rng.choice([2, 4, 16])
        max_len = rng.randrange(16, 80)
        limits = EngineLimits(rng.randrange(1, 6), rng.randrange(1, 40), max_len, block)
        blocks = ceil_div(max_len, block) + 1 + rng.randrange(0, 20)
        sched = Scheduler(BlockPool(blocks), limits, eos_token_ids=(3,))
        reqs = [
            sched.add(
                [rng.randrange(5, 100) for _ in range(rng.randrange(1, max_len))],
                SamplingParams(max_tokens=rng.randrange(1, 50)),
            )
            for _ in range(rng.randrange(1, 8))
        ]
        drive(sched, rng)
        assert all(r.finished for r in reqs)
        assert sched.pool.num_free == blocks - 1


def test_chunks_sample_only_at_the_end_of_the_prompt():
    sched = Scheduler(BlockPool(20), EngineLimits(2, 5, 64, 4))
    req = sched.add(list(range(1, 13)), SamplingParams(max_tokens=2, ignore_eos=True))
    starts = []
    while not req.finished:
        step = sched.schedule()
        (s,) = step.scheduled
        starts.append((s.start, len(s.tokens), s.samples))
        sched.update(step, [7])
    assert starts == [(0, 5, False), (5, 5, False), (10, 2, True), (12, 1, True)]
    assert req.output == [7, 7] and req.finish_reason is FinishReason.LENGTH


def test_abort_frees_waiting_and_running_requests():
    sched = Scheduler(BlockPool(20), EngineLimits(1, 64, 64, 4))
    a = sched.add([1, 2, 3], SamplingParams())
    b = sched.add([4, 5], SamplingParams())
    sched.update(sched.schedule(), [9])  # a runs; b waits (one sequence at a time)
    assert a in sched.running and b in sched.waiting
    sched.abort([a, b])
    assert not sched.has_work and sched.pool.num_free == 19
    assert a.finish_reason is b.finish_reason is FinishReason.ABORT
