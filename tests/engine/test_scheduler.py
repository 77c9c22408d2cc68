"""The scheduler on its own: chunked prefill, preemption and readmission under any token
budget, abort, and the bookkeeping of blocks."""

import random

import pytest

from ostinato.engine import FinishReason, SamplingParams
from ostinato.engine.core.kv_cache import BlockPool
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.scheduler import Scheduler
from ostinato.mathutil import ceil_div


def drive(sched, rng, steps=10_000, abort_every=0):
    """Runs the scheduler with random sampled tokens until no work is left (aborting a
    random running request about every ``abort_every`` steps, 0: never); returns the
    number of steps run."""
    device = [None] * (sched.lora_slots.capacity if sched.lora_slots else 0)  # loads written
    for done in range(steps):
        if not sched.has_work:
            return done
        step = sched.schedule()
        assert step.scheduled, "an empty step with work pending is a hang"
        for load in step.lora_loads:
            device[load.slot] = load.adapter
        check_lora_slots(sched, step, device)
        assert step.num_tokens <= sched.max_num_batched_tokens
        for s in step.scheduled:
            r = s.request
            assert s.tokens == (r.prompt + r.output)[s.start : s.start + len(s.tokens)]
            assert len(r.blocks) * sched.block_size >= s.start + len(s.tokens)
            # A step writes only blocks its request holds alone (shared ones are read).
            written = range(s.start // sched.block_size, len(r.blocks))
            assert all(sched.pool.holders(r.blocks[b]) == 1 for b in written)
        sched.update(step, [rng.randrange(3, 100) for _ in step.scheduled])
        if abort_every and sched.running and rng.randrange(abort_every) == 0:
            sched.abort([rng.choice(sched.running)])
    raise AssertionError("did not finish")


def check_lora_slots(sched, step, device):
    """Every slot is free or used exactly by the running requests that hold it, each
    holding its own adapter, written to the device by the time its step runs."""
    slots = sched.lora_slots
    if slots is None:
        return
    for s in range(slots.capacity):
        users = [r for r in sched.running if r.lora_slot == s]
        assert slots.users[s] == len(users)
        assert all(slots.held[s] is r.lora is device[s] for r in users)
    assert all(r.lora_slot == -1 for r in sched.waiting)
    assert all((r.lora is None) == (r.lora_slot == -1) for r in sched.running)
    for sr in step.scheduled:
        r = sr.request
        assert r.lora is None or device[r.lora_slot] is r.lora


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


def test_the_samples_of_a_prompt_read_its_full_blocks_from_the_first():
    # n = 3, a 10-token prompt in blocks of 4: the two full blocks (tokens 0-7) are
    # computed once, by the first sample; the others hold them too and compute from
    # token 8 (their last prompt token's logits are their own), in blocks of their own.
    sched = Scheduler(BlockPool(40), EngineLimits(8, 64, 64, 4))
    leader = sched.add(list(range(1, 11)), SamplingParams(max_tokens=5, ignore_eos=True, n=3))
    assert len(leader.group) == 3 and all(o.leader is leader for o in leader.others)
    first = sched.schedule()
    assert [(s.request, s.start) for s in first.scheduled] == [(leader, 0)]  # the rest wait
    sched.update(first, [7])
    second = sched.schedule()
    assert [(s.request, s.start, len(s.tokens)) for s in second.scheduled] == [
        (leader, 10, 1),
        *((o, 8, 2) for o in leader.others),
    ]
    for o in leader.others:
        assert o.blocks[:2] == leader.blocks[:2] and not set(o.blocks[2:]) & set(leader.blocks)
    assert all(sched.pool.holders(b) == 3 for b in leader.blocks[:2])
    drive(sched, random.Random(0))
    assert all(r.finished and len(r.output) == 5 for r in leader.group)
    assert sched.pool.num_free == 39


@pytest.mark.parametrize("max_n", [1, 4])
def test_random_workloads_always_finish_and_return_every_block(max_n):
    # With max_n > 1 prompts ask for several samples: preemption of leaders and samples,
    # chunked prefills, aborts of a leader (which end its samples); every block comes
    # back, and a step never writes a shared block (drive).
    rng = random.Random(max_n)
    for _ in range(40):
        block = rng.choice([2, 4, 16])
        max_len = rng.randrange(16, 80)
        limits = EngineLimits(rng.randrange(1, 6), rng.randrange(1, 40), max_len, block)
        blocks = ceil_div(max_len, block) + 1 + rng.randrange(0, 20)
        sched = Scheduler(BlockPool(blocks), limits, eos_token_ids=(3,))
        reqs = [
            sched.add(
                [rng.randrange(5, 100) for _ in range(rng.randrange(1, max_len))],
                SamplingParams(max_tokens=rng.randrange(1, 50), n=rng.randrange(1, max_n + 1)),
            )
            for _ in range(rng.randrange(1, 8))
        ]
        if max_n > 1 and rng.random() < 0.3:  # a step, then one prompt's leader aborted
            step = sched.schedule()
            sched.update(step, [rng.randrange(3, 100) for _ in step.scheduled])
            sched.abort([rng.choice(reqs)])
        drive(sched, rng)
        assert all(r.all_finished for r in reqs)
        assert sched.pool.num_free == blocks - 1


def test_aborting_a_leader_ends_its_samples():
    sched = Scheduler(BlockPool(40), EngineLimits(8, 64, 64, 4))
    leader = sched.add(list(range(1, 11)), SamplingParams(max_tokens=5, n=3))
    sched.update(sched.schedule(), [7])
    sched.update(sched.schedule(), [7, 8, 9])
    sched.abort([leader])
    assert all(r.finish_reason is FinishReason.ABORT for r in leader.group)
    assert not sched.has_work and sched.pool.num_free == 39


def test_random_adapter_mixes_leave_every_slot_free_or_held_by_a_running_request():
    # Thousands of steps over random workloads of up to 5 adapters and 1 to 3 slots, with
    # preemption, chunked prefills, samples and aborts; drive checks the slots every step.
    from ostinato.engine.core.lora_slots import LoraAdapter, LoraSlots

    rng = random.Random(66)
    adapters = [LoraAdapter(f"a{i}", 4, None) for i in range(5)]
    steps = preemptions = 0
    for _ in range(30):
        limits = EngineLimits(rng.randrange(1, 6), rng.randrange(4, 40), 64, 4)
        slots = LoraSlots(rng.randrange(1, 4))
        sched = Scheduler(BlockPool(17 + rng.randrange(0, 20)), limits, lora_slots=slots)
        reqs = [
            sched.add(
                [rng.randrange(5, 100) for _ in range(rng.randrange(1, 40))],
                SamplingParams(max_tokens=rng.randrange(1, 30), n=rng.randrange(1, 3)),
                rng.choice([None, *adapters]),
            )
            for _ in range(rng.randrange(2, 12))
        ]
        steps += drive(sched, rng, abort_every=15)
        preemptions += sched.num_preemptions
        assert all(r.all_finished for r in reqs) and slots.users == [0] * slots.capacity
    assert steps > 1000 and preemptions > 0, (steps, preemptions)
