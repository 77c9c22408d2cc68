"""Speculative decoding on the GPU: verify steps (uniform batches of 1 + k tokens per
request) replayed from FULL graphs equal eager verification, and greedy outputs with
speculation equal plain greedy decoding in every graph mode."""

import random

import pytest
import torch
from gpu_harness import tiny_engine

from ostinato.engine import SamplingParams
from ostinato.engine.sample.verify import verify
from ostinato.engine.spec.speculative import SpeculativeConfig

pytestmark = pytest.mark.gpu


def workload():
    rng = random.Random(9)
    loop = [rng.randrange(1, 1000) for _ in range(5)]
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(2, 50))] for _ in range(6)]
    prompts += [loop * 6, loop * 3]
    params = [SamplingParams(max_tokens=rng.randint(10, 40), ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize("mode", ["full", "full_and_piecewise"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_speculation_equals_plain_in_graph_modes(mode, k):
    prompts, params = workload()
    plain = [o.token_ids for o in tiny_engine(mode, torch.float32).generate(prompts, params)]
    oracle = SpeculativeConfig(
        "oracle", k, oracle=dict(zip(map(tuple, prompts), plain, strict=True))
    )
    for spec in ("ngram", "self:2", oracle):
        llm = tiny_engine(mode, torch.float32, speculative=spec, num_speculative_tokens=k)
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain, spec
        assert llm.spec_stats.verifications > 0


def test_verify_steps_from_graphs_equal_eager_verify():
    prompts, params = workload()
    spec = dict(speculative="self:2", num_speculative_tokens=3)
    eager = tiny_engine("none", torch.float32, **spec)
    graphs = tiny_engine("full", torch.float32, **spec)
    for llm in (eager, graphs):
        for p, sp in zip(prompts, params, strict=True):
            llm.scheduler.add(p, sp)
    uniform_steps = 0
    while eager.has_work:
        se, sg = eager.scheduler.schedule(), graphs.scheduler.schedule()
        assert [(s.request.id, s.tokens) for s in se.scheduled] == [
            (s.request.id, s.tokens) for s in sg.scheduled
        ]
        if sg.uniform_decode and any(s.draft for s in sg.scheduled):
            d = graphs.runner.graphs.dispatch(sg.num_tokens, True)
            assert d.mode.name == "FULL", d
            uniform_steps += 1
        le, lg = eager.runner.execute(se).logits.float(), graphs.runner.execute(sg).logits.float()
        assert ((lg - le).norm() / le.norm()).item() < 1e-4
        got = verify(le, se, None)
        eager.scheduler.update(se, got)
        graphs.scheduler.update(sg, got)
    assert uniform_steps > 3


@pytest.mark.parametrize("k", [2, 4])
def test_draft_graph_replay_equals_step_by_step_eager_drafting(k):
    from draft_reference import StepByStepDraft, check_drafts_against

    prompts, params = workload()
    llm = tiny_engine("full", torch.float32, speculative="self:2", num_speculative_tokens=k)
    assert llm.draft_report is not None and llm.draft_report.num_graphs > 0
    compared = check_drafts_against(StepByStepDraft(llm, 2), llm)
    llm.generate(prompts, params)
    assert sum(compared) > 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["full_and_piecewise", "full_decode_only", "full"])
def test_verify_steps_scheduled_ahead_equal_synchronous_ones_on_the_gpu(mode, dtype):
    # Longer answers (lookahead needs room for two full drafts) and an oracle wrong at
    # every fifth token, so each step queued ahead is completed differently per request
    # inside its FULL graph. FULL mode has no uniform decode graphs: every step in turn.
    prompts, _ = workload()
    rng = random.Random(5)
    params = [SamplingParams(max_tokens=rng.randint(40, 60), ignore_eos=True) for _ in prompts]
    plain = [o.token_ids for o in tiny_engine(mode, dtype).generate(prompts, params)]
    known = {
        tuple(p): [(t + 1) % 1000 if i % 5 == 3 else t for i, t in enumerate(out)]
        for p, out in zip(prompts, plain, strict=True)
    }
    runs = []
    for ahead in (True, False):
        spec = SpeculativeConfig("oracle", 3, oracle=known)
        llm = tiny_engine(mode, dtype, speculative=spec, async_scheduling=ahead)
        modes = []
        execute = llm.runner.execute

        def recording(step, *a, _execute=execute, _llm=llm, _modes=modes, **kw):
            if step.scheduled and step.scheduled[0].ahead:  # the dispatch execute makes
                d = _llm.runner.graphs.dispatch(step.num_tokens, step.uniform_decode)
                _modes.append(d.mode.name == "FULL" and d.descriptor.uniform_decode)
            return _execute(step, *a, **kw)

        llm.runner.execute = recording
        runs.append(([o.token_ids for o in llm.generate(prompts, params)], llm.spec_stats, modes))
    (got, st, full), (sync_got, sync_st, _) = runs
    assert got == sync_got
    if dtype is torch.float32:
        assert got == plain
    assert sync_st.ahead_steps == 0 and 0 < st.acceptance_rate < 1
    if mode == "full":
        assert st.ahead_steps == 0
    else:
        assert st.ahead_steps > 10 and len(full) == st.ahead_steps
        assert all(full), "every step scheduled ahead replays a uniform FULL graph"
    counts = (st.drafted, st.accepted, st.tokens)
    assert counts == (sync_st.drafted, sync_st.accepted, sync_st.tokens)


def test_fused_lookahead_ops_equal_the_torch_reference():
    # Random steps (uniform or not, scheduled ahead or not, with padding rows): the
    # Triton prepare and accept leave every buffer as the torch ops do.
    from ostinato.engine.core.limits import EngineLimits
    from ostinato.engine.core.scheduler import Request, ScheduledBatch, ScheduledRequest
    from ostinato.engine.spec.lookahead import VerifyLookahead
    from ostinato.engine.worker.inputs import StepInputs

    rng, k, cuda = random.Random(0), 3, torch.device("cuda")
    limits = EngineLimits(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=96, block_size=4)
    for _ in range(40):
        r, length = rng.randint(1, 6), rng.randint(1, k + 1)
        ahead = length == k + 1 and rng.random() < 0.5
        scheduled = []
        for i in range(r):
            start = rng.randint(1, 60)
            req = Request(i, [1] * start, SamplingParams(), blocks=rng.sample(range(1, 40), 24))
            tokens = [rng.randrange(100) for _ in range(length)]
            window = [rng.randrange(100) for _ in range(2 * k)] if ahead else []
            scheduled.append(
                ScheduledRequest(req, tokens, start, draft=tokens[1:], ahead=ahead, window=window)
            )
        step, padded = ScheduledBatch(scheduled), r * length + rng.randint(0, 5)
        carried = torch.tensor(
            [[rng.randint(0, k) for _ in range(6)], [rng.randrange(100) for _ in range(6)]]
        )
        runs = []
        for fused in (True, False):
            inputs = StepInputs(limits, cuda)
            lookahead = VerifyLookahead(inputs, k)
            assert lookahead.fused
            lookahead.fused = fused
            inputs.write(step, padded)
            lookahead.stage(step, padded)
            if ahead:
                lookahead.carried.copy_(carried)
            lookahead.prepare(padded)
            ids = inputs.input_ids[:padded].tolist()
            greedy = torch.tensor(
                [ids[i + 1] if i + 1 < padded and i % 3 else 7 for i in range(padded)], device=cuda
            )
            lookahead.accept(padded, greedy)
            buffers = (inputs.input_ids, inputs.positions, inputs.slot_mapping, lookahead.carried)
            runs.append([b.tolist() for b in buffers])
        assert runs[0] == runs[1]
