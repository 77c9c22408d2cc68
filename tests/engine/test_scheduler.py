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


def test_schedule_ahead_only_when_the_next_step_can_be_scheduled_blind():
    from ostinato.engine.core.scheduler import PENDING_TOKEN

    limits = EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=40, block_size=4)

    def window(requests, k):
        return [[100 + i for i in range(2 * k)] for _ in requests]

    def verifying(params, blocks=20, prompt_len=5, k=2):
        sched = Scheduler(
            BlockPool(blocks),
            limits,
            propose=lambda reqs, n: [[7] * m for m in n],
            num_speculative=k,
            lookahead=window,
        )
        reqs = [sched.add(list(range(1, prompt_len + 1)), p) for p in params]
        sched.update(sched.schedule(), [9] * len(reqs))  # the prefill; then a verify step
        step = sched.schedule()
        assert all(len(s.draft) == k for s in step.scheduled)
        sched.launched(step)
        return sched, step

    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    sched, step = verifying([greedy, greedy])
    ahead = sched.schedule_ahead(step)
    assert ahead is not None and all(s.ahead for s in ahead.scheduled)
    assert [s.start for s in ahead.scheduled] == [s.start + 1 for s in step.scheduled]
    assert ahead.scheduled[0].tokens == [PENDING_TOKEN] * 3
    # Blocks for the worst case: both drafts kept, then three more tokens.
    assert all(len(s.request.blocks) * 4 >= s.start + 6 for s in step.scheduled)
    # The first request keeps one draft, the second none: starts, drafts and tokens
    # follow, picked from each window.
    sched.resolve(step, [[7, 11], [12]])
    sched.settle_ahead(ahead, step, [[7, 11], [12]])
    first, second = ahead.scheduled
    assert (first.start, first.draft, first.tokens) == (
        step.scheduled[0].start + 2,
        [101, 102],
        [11, 101, 102],
    )
    assert (second.start, second.draft, second.tokens) == (
        step.scheduled[1].start + 1,
        [100, 101],
        [12, 100, 101],
    )
    assert first.request.num_pending == 1 and first.request.num_cached == first.start + 3

    # Not blind: a sampled request, a waiting one, too little room, no free block.
    sampled = SamplingParams(max_tokens=20, temperature=0.7)
    assert sched.schedule_ahead(verifying([greedy, sampled])[1]) is None
    s2, st2 = verifying([greedy])
    s2.add([1, 2, 3], greedy)
    assert s2.schedule_ahead(st2) is None
    short = SamplingParams(max_tokens=6, ignore_eos=True)  # 1 + 2 + 3 > 6 - 1
    assert sched.schedule_ahead(verifying([short])[1]) is None
    s3, st3 = verifying([greedy], prompt_len=34)  # 34 + 2 * 2 + 3 > 40
    assert s3.schedule_ahead(st3) is None
    s4, st4 = verifying([greedy, greedy], blocks=7, prompt_len=7)
    assert s4.schedule_ahead(st4) is None
    no_lookahead = Scheduler(
        BlockPool(20), limits, propose=lambda r, n: [[7] * m for m in n], num_speculative=2
    )
    no_lookahead.add([1, 2, 3], greedy)
    no_lookahead.update(no_lookahead.schedule(), [9])
    st5 = no_lookahead.schedule()
    no_lookahead.launched(st5)
    assert no_lookahead.schedule_ahead(st5) is None
