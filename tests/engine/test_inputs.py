"""The runner's persistent inputs: the row layout of a step and the padding convention."""

import random

import torch

from ostinato.engine import SamplingParams
from ostinato.engine.core.kv_cache import BlockPool
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.scheduler import Request, ScheduledBatch, ScheduledRequest, Scheduler
from ostinato.engine.worker.inputs import PADDING, StepInputs

LIMITS = EngineLimits(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)


def test_rows_of_a_mixed_step_and_its_padding():
    inputs = StepInputs(LIMITS, torch.device("cpu"))
    a = Request(0, [11, 12, 13, 14, 15, 16, 17], SamplingParams(), blocks=[5, 2])
    b = Request(1, [21, 22], SamplingParams(), output=[23], blocks=[7], num_cached=2)
    step = ScheduledBatch(
        [
            ScheduledRequest(a, [15, 16, 17], start=4),  # a chunk continuing a prefill
            ScheduledRequest(b, [23], start=2),  # a decode
        ]
    )
    layout = inputs.write(step, padded=8)
    assert inputs.input_ids[:8].tolist() == [15, 16, 17, 23] + [PADDING.token] * 4
    assert inputs.positions[:8].tolist() == [4, 5, 6, 2] + [PADDING.position] * 4
    assert inputs.token_req[:8].tolist() == [0, 0, 0, 1] + [PADDING.request] * 4
    # Position p of a request lives in slot blocks[p // 4] * 4 + p % 4.
    assert inputs.slot_mapping[:8].tolist() == [8, 9, 10, 30] + [PADDING.slot] * 4
    assert inputs.block_tables[0, :2].tolist() == [5, 2] and inputs.block_tables[1, 0] == 7
    assert layout.logit_rows.tolist() == [2, 3]
    assert layout.query_lens == [3, 1] and layout.seq_lens == [7, 3]
    # The padding slot is in the null block, which the pool never hands out.
    assert PADDING.slot // LIMITS.block_size == 0


def test_padding_rows_for_a_capture():
    inputs = StepInputs(LIMITS, torch.device("cpu"))
    inputs.input_ids.fill_(9)
    inputs.positions.fill_(3)
    inputs.write_padding(16)
    assert (inputs.input_ids[:16] == PADDING.token).all() and (inputs.input_ids[16:] == 9).all()
    assert (inputs.positions[:16] == PADDING.position).all()
    meta = inputs.metadata(16, [], [])
    assert (
        meta.positions.shape == (16,) and meta.positions.data_ptr() == inputs.positions.data_ptr()
    )


def test_buffers_never_move():
    inputs = StepInputs(LIMITS, torch.device("cpu"))
    before = [t.data_ptr() for t in (inputs.input_ids, inputs.positions, inputs.block_tables)]
    r = Request(0, [1, 2, 3], SamplingParams(), blocks=[1])
    for _ in range(3):
        inputs.write(ScheduledBatch([ScheduledRequest(r, [1, 2, 3], 0)]), padded=4)
    after = [t.data_ptr() for t in (inputs.input_ids, inputs.positions, inputs.block_tables)]
    assert before == after


def test_a_drafting_request_needs_the_logits_of_its_last_token_and_each_draft():
    limits = EngineLimits(4, 64, 64, 16)
    inputs = StepInputs(limits, torch.device("cpu"))
    a = Request(0, [1, 2, 3], SamplingParams(), output=[4], blocks=[1], num_cached=3)
    b = Request(1, [5], SamplingParams(), output=[6], blocks=[2], num_cached=1)
    step = ScheduledBatch(
        [
            ScheduledRequest(a, [4, 7, 8], 3, draft=[7, 8]),
            ScheduledRequest(b, [6], 1),
        ]
    )
    layout = inputs.write(step, 8)
    assert layout.logit_rows.tolist() == [0, 1, 2, 3]
    assert inputs.input_ids[:4].tolist() == [4, 7, 8, 6]
    assert inputs.positions[:5].tolist() == [3, 4, 5, 1, -1]


def test_block_tables_and_slots_follow_a_preempting_schedule():
    # Only changed table rows are staged again; through admissions, growth, preemptions
    # (a new list for the same request) and finishes (another request in the row), the
    # device tables and slots still hold each scheduled request's blocks.
    limits = EngineLimits(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=48, block_size=4)
    sched = Scheduler(BlockPool(13), limits)
    inputs = StepInputs(limits, torch.device("cpu"))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    reqs = [sched.add(list(range(1, 2 + 5 * i)), params) for i in range(6)]
    while sched.has_work:
        step = sched.schedule()
        inputs.write(step, step.num_tokens)
        row = 0
        for r, s in enumerate(step.scheduled):
            blocks = s.request.blocks
            assert inputs.block_tables[r, : len(blocks)].tolist() == blocks
            for p in range(s.start, s.start + len(s.tokens)):
                assert inputs.slot_mapping[row] == blocks[p // 4] * 4 + p % 4
                row += 1
        sched.update(step, [rng.randrange(3, 100) for _ in step.scheduled])
    assert sum(r.num_preemptions for r in reqs) > 0
