"""Lookahead's device half on its own: a step staged without lookahead is left exactly as
staged; a step scheduled ahead gets its ids, positions and slots from the previous
step's acceptance; acceptance follows the host's rule; padding rows are never touched."""

import torch

from ostinato.engine import SamplingParams
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.scheduler import PENDING_TOKEN, Request, ScheduledBatch, ScheduledRequest
from ostinato.engine.sample.verify import accept_greedy
from ostinato.engine.spec.lookahead import VerifyLookahead
from ostinato.engine.worker.inputs import PADDING, StepInputs

LIMITS = EngineLimits(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)
K = 2


def staged(step, padded=8):
    inputs = StepInputs(LIMITS, torch.device("cpu"))
    ahead = VerifyLookahead(inputs, K)
    inputs.write(step, padded)
    ahead.stage(step, padded)
    return inputs, ahead


def requests():
    a = Request(0, [1, 2, 3], SamplingParams(), output=[4], blocks=[5, 2, 9])
    b = Request(1, [6, 7], SamplingParams(), output=[8], blocks=[7, 3])
    return a, b


def test_a_step_not_scheduled_ahead_is_left_as_staged():
    a, b = requests()
    step = ScheduledBatch(
        [
            ScheduledRequest(a, [4, 50, 51], start=3, draft=[50, 51]),
            ScheduledRequest(b, [8, 60, 61], start=2, draft=[60, 61]),
        ]
    )
    inputs, ahead = staged(step)
    before = [t[:8].clone() for t in (inputs.input_ids, inputs.positions, inputs.slot_mapping)]
    ahead.prepare(8)
    after = [inputs.input_ids[:8], inputs.positions[:8], inputs.slot_mapping[:8]]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    # The argmax keeps a's first draft (then differs) and all of b's.
    greedy = torch.tensor([50, 70, 71, 60, 61, 62, 9, 9])
    ahead.accept(8, greedy)
    assert accept_greedy(step, greedy.tolist()[:6]) == [[50, 70], [60, 61, 62]]
    assert ahead.carried[:, :2].tolist() == [[1, 2], [70, 62]]


def test_a_step_scheduled_ahead_is_completed_from_the_previous_acceptance():
    a, b = requests()
    pending = [PENDING_TOKEN] * 3
    step = ScheduledBatch(
        [
            ScheduledRequest(
                a, list(pending), 4, draft=[0, 0], ahead=True, window=[11, 12, 13, 14]
            ),
            ScheduledRequest(
                b, list(pending), 3, draft=[0, 0], ahead=True, window=[21, 22, 23, 24]
            ),
        ]
    )
    inputs, ahead = staged(step)
    ahead.carried[:, :2] = torch.tensor([[2, 0], [40, 41]])  # kept drafts, the token after
    ahead.prepare(8)
    # a kept both drafts: it moves on by 2 and drafts window[2:4]; b kept none.
    assert inputs.input_ids[:6].tolist() == [40, 13, 14, 41, 21, 22]
    assert inputs.positions[:8].tolist() == [6, 7, 8, 3, 4, 5] + [PADDING.position] * 2
    # Position p of a request lives in slot blocks[p // 4] * 4 + p % 4.
    assert inputs.slot_mapping[:8].tolist() == [10, 11, 36, 31, 12, 13] + [PADDING.slot] * 2
    assert inputs.input_ids[6:8].tolist() == [PADDING.token] * 2


def test_bad_steps_are_refused_by_name():
    import pytest

    from ostinato.engine import LLM

    a, b = requests()
    mixed = ScheduledBatch(
        [
            ScheduledRequest(a, [PENDING_TOKEN] * 3, 4, draft=[0, 0], ahead=True, window=[1] * 4),
            ScheduledRequest(b, [8, 60, 61], start=2, draft=[60, 61]),
        ]
    )
    with pytest.raises(RuntimeError, match="scheduled ahead as a whole or not at all"):
        staged(mixed)
    uneven = ScheduledBatch(
        [ScheduledRequest(a, [4, 50, 51], 3, draft=[50, 51]), ScheduledRequest(b, [8], 2)]
    )
    with pytest.raises(RuntimeError, match="uniform decode steps only"):
        staged(uneven)
    # A runner made without lookahead (here: no oracle) refuses a step scheduled ahead.
    llm = LLM("tiny", device="cpu", max_model_len=64, progress=False, speculative="ngram")
    assert llm.runner.decode_hook is None and not llm.runner.verifies_ahead(6)
    a.blocks, b.blocks = [1], [2]
    ahead = ScheduledBatch(
        [ScheduledRequest(r, [PENDING_TOKEN] * 3, 1, draft=[0, 0], ahead=True) for r in (a, b)]
    )
    with pytest.raises(
        RuntimeError, match="only uniform decode steps of a runner with a decode hook"
    ):
        llm.runner.execute(ahead)
