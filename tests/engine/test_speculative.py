"""Speculative decoding on the CPU (NONE mode): greedy outputs equal plain decoding for
every proposer and k = 1..4, with preemption, chunked prefill and stop tokens; the
acceptance rule of sampled requests leaves the output distribution unchanged."""

import random
from collections import Counter

import pytest
import torch
from draft_reference import StepByStepDraft, check_drafts_against

from benchmarks.spec import OracleProposer
from ostinato.engine import LLM, SamplingParams
from ostinato.engine.core.scheduler import Request, ScheduledBatch, ScheduledRequest
from ostinato.engine.sample.verify import verify
from ostinato.engine.spec.speculative import NgramProposer, SpeculativeConfig


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


def stopping_midway(params, outputs):
    """``params`` with each request stopped at the token its output holds midway."""
    return [
        SamplingParams(
            max_tokens=p.max_tokens, ignore_eos=True, stop_token_ids=(out[len(out) // 2],)
        )
        for p, out in zip(params, outputs, strict=True)
    ]


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
            "custom", k, proposer=OracleProposer(dict(zip(map(tuple, prompts), plain, strict=True)))
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
    stops = stopping_midway(params, plain)
    want = [o.token_ids for o in engine(num_blocks=5, max_model_len=64).generate(prompts, stops)]
    oracle = SpeculativeConfig(
        "custom", 4, proposer=OracleProposer(dict(zip(map(tuple, prompts), plain, strict=True)))
    )
    for spec in (oracle, "self:1", "ngram"):
        llm = engine(num_blocks=5, max_model_len=64, max_num_batched_tokens=48, speculative=spec)
        got = llm.generate(prompts, stops)
        assert [o.token_ids for o in got] == want
        assert llm.num_preemptions > 0
        assert llm.free_kv_blocks == 4, "every block returned"


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
    with pytest.raises(ValueError, match="a proposer is given with method 'custom'"):
        SpeculativeConfig("custom", 2)
    with pytest.raises(ValueError, match="method 'oracle' is not one of"):
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


def wrong_every(tokens, every, offset=3):
    """``tokens`` with every ``every``-th one changed: an oracle that is sometimes wrong."""
    return [(t + 1) % 1000 if i % every == offset else t for i, t in enumerate(tokens)]


@pytest.fixture(scope="module")
def longer():
    """Longer answers (30 to 50 tokens): room for many full drafts."""
    prompts, _ = prompts_and_params()
    rng = random.Random(11)
    params = [SamplingParams(max_tokens=rng.randint(30, 50), ignore_eos=True) for _ in prompts]
    plain = [o.token_ids for o in engine(max_num_seqs=8).generate(prompts, params)]
    return prompts, params, plain


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_proposer_plug_in_that_is_sometimes_wrong_leaves_greedy_outputs_as_plain(longer, k):
    # A custom proposer wrong at every fifth token: some verify steps keep every draft,
    # others few; the outputs are plain decoding's, whatever async_scheduling says.
    prompts, params, plain = longer
    known = {tuple(p): wrong_every(out, 5) for p, out in zip(prompts, plain, strict=True)}
    runs = {}
    for asynchronous in (True, False):
        llm = engine(
            speculative=SpeculativeConfig("custom", k, proposer=OracleProposer(known)),
            async_scheduling=asynchronous,
            max_num_seqs=8,
        )
        runs[asynchronous] = ([o.token_ids for o in llm.generate(prompts, params)], llm.spec_stats)
    (got, st), (sync_got, sync_st) = runs[True], runs[False]
    assert got == sync_got == plain
    assert 0 < st.acceptance_rate < 1
    counts = (st.drafted, st.accepted, st.verifications, st.tokens)
    assert counts == (sync_st.drafted, sync_st.accepted, sync_st.verifications, sync_st.tokens)


def test_a_proposer_plug_in_with_stop_tokens_waiting_requests_and_sampling(plain):
    prompts, params = prompts_and_params()
    # Stop tokens met inside accepted drafts end a request; four sequences at most, so
    # requests wait; a sampled request shares steps. Greedy outputs still equal plain's.
    stops = stopping_midway(params, plain)
    want = [o.token_ids for o in engine().generate(prompts, stops)]
    known = {tuple(p): wrong_every(out, 7) for p, out in zip(prompts, plain, strict=True)}
    llm = engine(speculative=SpeculativeConfig("custom", 3, proposer=OracleProposer(known)))
    assert [o.token_ids for o in llm.generate(prompts, stops)] == want
    assert llm.spec_stats.accepted > 0
    assert llm.free_kv_blocks == llm.num_kv_blocks - 1, "blocks returned"
    sampled = SamplingParams(max_tokens=20, temperature=0.8)
    outs = llm.generate(prompts[:2] + prompts[:1], [stops[0], stops[1], sampled])
    assert [o.token_ids for o in outs[:2]] == want[:2]
    assert all(0 <= t < 1024 for t in outs[2].token_ids)
