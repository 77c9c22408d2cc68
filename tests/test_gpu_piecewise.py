"""GPU tests of piecewise graphs: PIECEWISE and FULL_AND_PIECEWISE vs eager in the engine."""

import random

import pytest
import torch

from ostinato.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[1 + i, 2 + 3 * i, 3, 4 + i * i % 97] * (1 + i % 3) for i in range(8)]


def _engine(mode, dtype, **kw):
    return LLM(
        "tiny",
        mode=mode,
        dtype=dtype,
        max_model_len=256,
        max_num_seqs=8,
        max_capture_size=64,
        progress=False,
        seed=3,
        **kw,
    )


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_greedy_tokens_identical_to_eager_fp32(mode):
    eager = _engine("none", torch.float32)
    graphs = _engine(mode, torch.float32)
    assert graphs.mode.name == mode.upper()
    assert graphs.runner.piecewise is not None and graphs.runner.piecewise.stats.compiles == 1
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = [o.token_ids for o in eager.generate(PROMPTS, params)]
    got = [o.token_ids for o in graphs.generate(PROMPTS, params)]
    assert got == want
    assert graphs.runner.piecewise.stats.compiles == 1, "one compilation for every size"
    assert graphs.runner.piecewise.num_graphs > 0


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_logits_match_eager_bf16_random_mixes(mode):
    eager = _engine("none", torch.bfloat16)
    graphs = _engine(mode, torch.bfloat16)
    for llm in (eager, graphs):
        r = random.Random(11)
        for _ in range(12):
            llm.scheduler.add(
                [r.randrange(1, 1000) for _ in range(r.randint(1, 40))],
                SamplingParams(max_tokens=r.randint(1, 20), ignore_eos=True),
            )
    modes_seen = set()
    while eager.scheduler.has_work:
        se, sg = eager.scheduler.schedule(), graphs.scheduler.schedule()
        plan = graphs.runner.graphs.dispatch(sg.num_tokens, sg.uniform_decode)
        modes_seen.add(plan.mode.name)
        le, lg = eager.runner.execute(se), graphs.runner.execute(sg)
        err = ((lg - le).norm() / le.norm()).item()
        assert err < 2e-2, (plan, err)
        tokens = le.argmax(-1).tolist()
        eager.scheduler.update(se, tokens)
        graphs.scheduler.update(sg, tokens)
    expected = {"PIECEWISE"} if mode == "piecewise" else {"PIECEWISE", "FULL"}
    assert expected <= modes_seen, modes_seen


def test_default_engine_mode_on_cuda_is_full_and_piecewise():
    llm = LLM("tiny", max_model_len=128, max_num_seqs=4, max_capture_size=16, progress=False)
    assert llm.mode.name == "FULL_AND_PIECEWISE"
    assert llm.runner.compile_seconds > 0
    report = llm.capture_report
    assert {r.mode.name for r in report.records} == {"FULL", "PIECEWISE"}
