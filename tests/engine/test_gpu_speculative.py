"""Speculative decoding on the GPU: verify steps (uniform batches of 1 + k tokens per
request) replayed from FULL graphs equal eager verification, and greedy outputs with
speculation equal plain greedy decoding in every graph mode."""

import random

import pytest
import torch
from gpu_harness import tiny_engine

from benchmarks.spec import OracleProposer
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
        "custom", k, proposer=OracleProposer(dict(zip(map(tuple, prompts), plain, strict=True)))
    )
    for spec in ("ngram", "self:2", oracle):
        # (a SpeculativeConfig carries its own k; num_speculative_tokens beside it is refused)
        k_arg = {} if isinstance(spec, SpeculativeConfig) else {"num_speculative_tokens": k}
        llm = tiny_engine(mode, torch.float32, speculative=spec, **k_arg)
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain, spec
        assert llm.spec_stats.verifications > 0


def test_verify_steps_from_graphs_equal_eager_verify():
    prompts, params = workload()
    spec = dict(speculative="self:2", num_speculative_tokens=3)
    eager = tiny_engine("none", torch.float32, **spec)
    graphs = tiny_engine("full", torch.float32, **spec)
    for llm in (eager, graphs):
        for p, sp in zip(prompts, params, strict=True):
            llm.engine.scheduler.add(p, sp)
    uniform_steps = 0
    while eager.has_work:
        se, sg = eager.engine.scheduler.schedule(), graphs.engine.scheduler.schedule()
        assert [(s.request.id, s.tokens) for s in se.scheduled] == [
            (s.request.id, s.tokens) for s in sg.scheduled
        ]
        if sg.uniform_decode and any(s.draft for s in sg.scheduled):
            d = graphs.engine.runner.graphs.dispatch(sg.num_tokens, True)
            assert d.mode.name == "FULL", d
            uniform_steps += 1
        le, lg = (
            eager.engine.runner.execute(se).logits.float(),
            graphs.engine.runner.execute(sg).logits.float(),
        )
        assert ((lg - le).norm() / le.norm()).item() < 1e-4
        got = verify(le, se, None)
        eager.engine.scheduler.update(se, got)
        graphs.engine.scheduler.update(sg, got)
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
