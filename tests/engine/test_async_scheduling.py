"""Asynchronous scheduling (step N+1 prepared while step N runs) changes nothing in the
outputs, with preemption, chunked prefill and stop tokens; the host path of a step does a
fixed amount of tensor work whatever the batch size."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from workloads import random_mix

from ostinato.engine import LLM, SamplingParams
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.scheduler import Request, ScheduledBatch, ScheduledRequest
from ostinato.engine.worker.inputs import PreviousSample, StepInputs


def engine(async_scheduling, **kw):
    base = dict(model="tiny", device="cpu", max_model_len=64, max_num_seqs=4, progress=False)
    return LLM(async_scheduling=async_scheduling, **{**base, **kw})


def mix(seed):
    return random_mix(seed, n=9, max_prompt=40, max_new=24, vocab=500, stops=40)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "limits",
    [
        dict(num_blocks=6),  # 5 usable blocks of 16 for 4 sequences: preemption
        dict(num_blocks=6, max_num_batched_tokens=64),  # and chunked prefills
        dict(),
    ],
)
def test_async_and_sync_engines_give_identical_outputs(seed, limits):
    prompts, params = mix(seed)
    sync, asyn = engine(False, **limits), engine(True, **limits)
    want = sync.generate(prompts, params)
    got = asyn.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [
        (o.token_ids, o.finish_reason) for o in want
    ]
    assert asyn.num_preemptions > 0 or "num_blocks" not in limits
    assert asyn.free_kv_blocks == sync.free_kv_blocks, "every block returned"
    assert not asyn.has_work


def test_async_engine_streams_every_token_and_stays_usable_after_an_error():
    prompts, params = mix(3)
    llm = engine(True, num_blocks=6)
    seen = {}
    outs = llm.generate(prompts, params, on_token=lambda i, t: seen.setdefault(i, []).append(t))
    assert [seen.get(i, []) for i in range(len(prompts))] == [o.token_ids for o in outs]

    def boom(i, t):
        raise KeyError("stop")

    with pytest.raises(KeyError):
        llm.generate(prompts, params, on_token=boom)
    assert not llm.has_work and llm.free_kv_blocks == 5
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def ops_to_stage(batch, from_previous):
    limits = EngineLimits(32, 256, 64, 16)
    inputs = StepInputs(limits, torch.device("cpu"))
    step = ScheduledBatch(
        [
            ScheduledRequest(
                Request(i, [5] * 10, SamplingParams(), blocks=[i + 1]),
                [7],
                10,
                from_previous=from_previous,
            )
            for i in range(batch)
        ]
    )
    previous = PreviousSample(torch.arange(batch), {i: i for i in range(batch)})
    with OpCounter() as counter:
        inputs.write(step, batch, previous)
    return counter.ops


def test_tokens_carried_to_the_next_step_survive_writes_to_the_pool_between_steps():
    # A sampling graph's tokens are a view of the pool every graph shares, and work
    # between two steps may replay a graph whose intermediates overlap them (a recapture
    # timing the graph it would replace, on the H200: an illegal address in the next
    # step's embedding). Here the sampler's tokens sit in a stand-in for the pool, which
    # every callback between two steps overwrites: the next steps' decodes must still
    # read the tokens drawn.
    prompts, params = mix(4)
    want = engine(False).generate(prompts, params)
    llm = engine(True)
    sampler = llm.engine.loop.sampler
    pool = torch.zeros(16, dtype=torch.long)
    drawn = sampler.tokens

    def in_pool(*args, **kwargs):
        tokens = drawn(*args, **kwargs)
        pool[: tokens.shape[0]].copy_(tokens)
        return pool[: tokens.shape[0]]

    sampler.tokens = in_pool
    got = llm.generate(prompts, params, on_token=lambda i, t: pool.fill_(-7))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("from_previous", [False, True])
def test_staging_a_step_does_fixed_tensor_work_whatever_the_batch(from_previous):
    assert ops_to_stage(2, from_previous) == ops_to_stage(32, from_previous)


@pytest.mark.parametrize(
    "requests, sampled",
    [
        ([0, 1, 2, 3], [0, 1, 2, 3]),  # a steady decode: one device copy
        ([0, 1, 2, 3], [0, 1, 2, 3, 4]),  # the previous step had one more, last
        ([1, 2, 3, 4], [0, 1, 2, 3, 4]),  # request 0 finished: a gather
        ([0, 1, 2, 3], [2, 0, 3, 1]),  # another order: a gather
    ],
)
def test_decodes_take_their_previous_samples_whatever_the_order(requests, sampled):
    inputs = StepInputs(EngineLimits(32, 256, 64, 16), torch.device("cpu"))
    step = ScheduledBatch(
        [
            ScheduledRequest(
                Request(r, [5] * 10, SamplingParams(), blocks=[r + 1]), [7], 10, from_previous=True
            )
            for r in requests
        ]
    )
    # Request r's sample sits at its place in the previous step's order.
    tokens = torch.tensor([100 + r for r in sampled])
    previous = PreviousSample(tokens, {r: j for j, r in enumerate(sampled)})
    layout = inputs.write(step, len(requests) + 2, previous)
    assert inputs.input_ids[: len(requests)].tolist() == [100 + r for r in requests]
    assert inputs.input_ids[len(requests) : len(requests) + 2].tolist() == [0, 0]  # padding
    assert layout.logit_rows.tolist() == list(range(len(requests)))


def test_a_prefill_s_logit_rows_are_its_last_rows():
    inputs = StepInputs(EngineLimits(32, 256, 64, 16), torch.device("cpu"))
    step = ScheduledBatch(
        [
            ScheduledRequest(Request(r, [5] * 3, SamplingParams(), blocks=[r + 1]), [5] * 3, 0)
            for r in range(2)
        ]
    )
    assert inputs.write(step, 8).logit_rows.tolist() == [2, 5]
