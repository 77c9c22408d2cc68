"""Speculative decoding on the CPU (NONE mode): greedy outputs equal plain decoding for
every proposer and k = 1..4, with preemption, chunked prefill and stop tokens; the
acceptance rule of sampled requests leaves the output distribution unchanged."""

import random
from collections import Counter

import pytest
import torch
from draft_reference import StepByStepDraft, check_drafts_against

from ostinato.engine import LLM, SamplingParams
from ostinato.engine.scheduler import Request, ScheduledBatch, ScheduledRequest
from ostinato.engine.speculative import NgramProposer, SpeculativeConfig, verify


def prompts_and_params():
    rng = random.Random(7)
    loop = [rng.randrange(1, 1000) for _ in range(6)]
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(2, 40))] for _ in range(5)] + [
        loop * 5,
        loop * 2 + [3, 4],
    ]  # repeats: prompt lookup has something to find
    params = [SamplingParams(max_tokens=rng.randint(8, 30), ignore_eos=True) for _ in prompts]
    return prompts, params


def engine(**kw):
    base = dict(model="tiny", device="cpu", max_model_len=128, max_num_seqs=4, progress=False)
    return LLM(**{**base, **kw})


@pytest.fixture(scope="module")
def plain():
    prompts, params = prompts_and_params()
    return [o.token_ids for o in engine().generate(prompts, params)]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("method", ["ngram", "self:2", "oracle"])
def test_greedy_outputs_equal_plain_decoding(plain, method, k):
    prompts, params = prompts_and_params()
    if method == "oracle":
        spec = SpeculativeConfig(
            "oracle", k, oracle=dict(zip(map(tuple, prompts), plain, strict=True))
        )
    else:
        spec = SpeculativeConfig.parse(method, k)
    llm = engine(speculative=spec)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    stats = llm.spec_stats
    assert stats.verifications > 0 and stats.drafted > 0
    if method == "oracle":  # it knows the answer: every draft token is kept
        assert stats.acceptance_rate == 1.0
        assert stats.tokens_per_verification > k  # up to k + 1 per target step


def test_speculation_with_preemption_chunked_prefill_and_stop_tokens(plain):
    prompts, params = prompts_and_params()
    # Stop each request at a token it produces midway (often inside an accepted draft).
    stops = [
        SamplingParams(
            max_tokens=p.max_tokens, ignore_eos=True, stop_token_ids=(out[len(out) // 2],)
        )
        for p, out in zip(params, plain, strict=True)
    ]
    want = [o.token_ids for o in engine(num_blocks=5, max_model_len=64).generate(prompts, stops)]
    oracle = SpeculativeConfig(
        "oracle", 4, oracle=dict(zip(map(tuple, prompts), plain, strict=True))
    )
    for spec in (oracle, "self:1", "ngram"):
        llm = engine(num_blocks=5, max_model_len=64, max_num_batched_tokens=48, speculative=spec)
        got = llm.generate(prompts, stops)
        assert [o.token_ids for o in got] == want
        assert llm.scheduler.num_preemptions > 0
        assert llm.scheduler.pool.num_free == 4, "every block returned"


def test_ngram_proposer_finds_the_latest_repeat():
    ngram = NgramProposer(max_n=3)
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]
    assert ngram.propose([5, 6, 5], 3) == [6, 5]
    assert ngram.propose([1, 2, 3], 2) == []


def test_bad_speculative_settings_are_named():
    with pytest.raises(ValueError, match="method 'medusa' is not one of"):
        SpeculativeConfig.parse("medusa")
    with pytest.raises(ValueError, match="write self:N"):
        SpeculativeConfig.parse("self:x")
    with pytest.raises(ValueError, match="k must be an integer in 1..16"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(ValueError, match="needs the known tokens"):
        SpeculativeConfig("oracle", 2)
    with pytest.raises(ValueError, match="fewer layers than the model's 4"):
        engine(speculative="self:4")
    with pytest.raises(TypeError, match="speculative: expected 'ngram', 'self:N' or a"):
        engine(speculative=3)


def one_verify(logits, draft, params, gen):
    req = Request(0, [1], params, output=[2])
    step = ScheduledBatch([ScheduledRequest(req, [2, *draft], 1, draft=list(draft))])
    return verify(logits, step, gen)[0]


def test_rejection_sampling_keeps_the_target_distribution():
    # Two positions over a vocabulary of 6; the draft proposes token 2 (p = 0.3) then 0.
    p0 = torch.tensor([0.1, 0.05, 0.3, 0.25, 0.2, 0.1])
    p1 = torch.tensor([0.4, 0.1, 0.1, 0.1, 0.2, 0.1])
    p2 = torch.full((6,), 1 / 6)
    logits = torch.stack([p0, p1, p2]).log()
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    first, second = Counter(), Counter()
    for _ in range(n):
        out = one_verify(logits, [2, 0], params, gen)
        first[out[0]] += 1
        if out[0] == 2:
            second[out[1]] += 1
    tv1 = 0.5 * sum(abs(first[t] / n - float(p0[t])) for t in range(6))
    m = sum(second.values())
    tv2 = 0.5 * sum(abs(second[t] / m - float(p1[t])) for t in range(6))
    assert tv1 < 0.02 and tv2 < 0.03, (tv1, tv2)


def test_sampled_requests_with_speculation_run_and_stay_in_the_vocabulary():
    prompts, _ = prompts_and_params()
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, ignore_eos=True)
    llm = engine(speculative="self:2", num_speculative_tokens=3)
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert all(0 <= t < llm.config.vocab_size for o in outs for t in o.token_ids)
    assert llm.spec_stats.accepted > 0


@pytest.mark.parametrize("k", [1, 3])
def test_the_device_side_draft_loop_drafts_what_step_by_step_drafting_does(k):
    prompts, params = prompts_and_params()
    llm = engine(speculative="self:2", num_speculative_tokens=k)
    compared = check_drafts_against(StepByStepDraft(llm, 2), llm)
    llm.generate(prompts, params)
    assert sum(compared) > 20 and llm.spec_stats.accepted > 0
