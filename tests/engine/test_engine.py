"""The engine on CPU: scheduling, preemption, sampling, bad input, API."""

import pytest
import torch

from ostinato.engine import LLM, FinishReason, SamplingParams
from ostinato.engine.core.kv_cache import BlockPool
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.scheduler import Scheduler
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.presets import shape
from ostinato.engine.sample.sampler import sample


def tiny(**kw):
    base = dict(model="tiny", device="cpu", max_model_len=96, max_num_seqs=4, progress=False)
    return LLM(**{**base, **kw})


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14], [15, 16], [17, 18, 19, 20, 21]]


def test_preemption_loses_nothing_and_changes_nothing():
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    roomy = tiny().generate(PROMPTS, greedy)
    # 8 usable blocks of 16 tokens for up to 4 sequences of up to ~26 tokens: must preempt.
    tight = tiny(num_blocks=9)
    out = tight.generate(PROMPTS, greedy)
    assert [o.token_ids for o in out] == [o.token_ids for o in roomy]
    assert all(len(o.token_ids) == 20 and o.finish_reason is FinishReason.LENGTH for o in out)
    assert tight.free_kv_blocks == 8, "every block returned"


def test_preemption_happened_with_tight_cache():
    llm = tiny(num_blocks=5, max_model_len=64)
    reqs = [
        llm.engine.scheduler.add(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in PROMPTS
    ]
    while llm.has_work:
        llm.step()
    assert sum(r.num_preemptions for r in reqs) > 0
    assert all(len(r.output) == 30 for r in reqs)


def test_more_requests_than_sequences_wait_their_turn():
    llm = tiny(max_num_seqs=2)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out) == len(PROMPTS) and all(len(o.token_ids) == 3 for o in out)


def test_generation_stops_at_max_model_len():
    llm = tiny(max_model_len=24)
    (o,) = llm.generate([[1] * 20], SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(o.token_ids) == 4 and o.finish_reason is FinishReason.MAX_MODEL_LEN


def test_stop_token():
    llm = tiny()
    (free,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=10, ignore_eos=True))
    stop = free.token_ids[3]
    (o,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))
    assert o.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    assert o.finish_reason is FinishReason.STOP


@pytest.mark.parametrize(
    "prompts, message",
    [
        ([[]], "prompt 0: empty"),
        ([[1, 2], [1] * 96], "prompt 1: 96 tokens leave no room"),
        ([[5000]], "outside the vocabulary"),
        (["hello"], "no tokenizer"),
    ],
)
def test_bad_prompts_rejected_before_anything_runs(prompts, message):
    llm = tiny()
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts)
    assert not llm.has_work, "no prompt half-accepted"


def test_a_prompt_over_the_token_budget_is_prefilled_in_chunks():
    prompts = [[1, 2], [(7 * i) % 1000 for i in range(100)]]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    roomy = tiny(max_model_len=256).generate(prompts, greedy)
    llm = tiny(max_model_len=256, max_num_batched_tokens=24)
    steps = []
    real_step = llm.engine.runner.execute

    def spy(step, *rest):
        steps.append(step.num_tokens)
        return real_step(step, *rest)

    llm.engine.runner.execute = spy
    chunked = llm.generate(prompts, greedy)
    assert max(steps) <= 24 and sum(steps) > 100
    assert [o.token_ids for o in chunked] == [o.token_ids for o in roomy]


def test_prompt_larger_than_whole_cache_is_an_error_not_a_hang():
    sched = Scheduler(BlockPool(3), EngineLimits(4, 2048, 1024, 16))
    with pytest.raises(ValueError, match="more KV blocks than the cache has"):
        sched.add(list(range(40)), SamplingParams())


def test_unknown_architecture():
    with pytest.raises(ValueError, match="architectures: .*GPT2LMHeadModel.* not supported"):
        ModelConfig.from_hf({**shape("tiny"), "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="missing field 'vocab_size'"):
        ModelConfig.from_hf({k: v for k, v in shape("tiny").items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="rope_type: 'yarn' not supported"):
        ModelConfig.from_hf({**shape("tiny"), "rope_scaling": {"rope_type": "yarn", "factor": 2}})


def test_sampling_params_validation():
    for kw, msg in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
    ]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw)


def test_sampler_greedy_top_p_and_seeded_temperature():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 2.9]])
    zero = torch.zeros(2)
    assert sample(logits, zero, torch.ones(2)).tolist() == [1, 0]
    hot = torch.full((2,), 5.0)
    # top_p tiny keeps only the most likely token, whatever the temperature.
    assert sample(logits, hot, torch.full((2,), 1e-6)).tolist() == [1, 0]
    a = sample(
        logits.repeat(50, 1), hot.repeat(50), torch.ones(100), torch.Generator().manual_seed(1)
    )
    b = sample(
        logits.repeat(50, 1), hot.repeat(50), torch.ones(100), torch.Generator().manual_seed(1)
    )
    assert torch.equal(a, b) and len(set(a.tolist())) > 1


def test_sampling_logits_in_the_model_dtype_equals_sampling_their_float32_cast():
    # The step hands its logits over in the model's dtype (no float32 cast in the decode
    # graph); the sampler's softmax casts them, so the tokens are those of the cast.
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 500, generator=g) * 4).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first index wins
    temps = torch.tensor([0.0, 0.7] * 32)
    tops = torch.tensor([1.0, 0.9] * 32)
    got = sample(logits, temps, tops, torch.Generator().manual_seed(5))
    want = sample(logits.float(), temps, tops, torch.Generator().manual_seed(5))
    assert torch.equal(got, want) and got[0] == 7


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_tokens_follow_the_softmax_restricted_to_top_p(top_p):
    # 20000 draws of 4 tokens whose probabilities at temperature 2 are known; with
    # top_p = 0.8 the least likely tokens outside the nucleus are never drawn.
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = torch.softmax(logits / 2.0, dim=0)
    n = 20000
    got = sample(
        logits.repeat(n, 1),
        torch.full((n,), 2.0),
        torch.full((n,), top_p),
        torch.Generator().manual_seed(7),
    )
    counts = torch.bincount(got, minlength=4).double() / n
    kept = (torch.cumsum(p, 0) - p) < top_p
    want = torch.where(kept, p, torch.zeros_like(p)).double()
    want /= want.sum()
    assert torch.all(counts[~kept] == 0)
    assert torch.allclose(counts, want, atol=0.015), (counts, want)


def test_mixed_greedy_and_sampled_requests_in_one_batch():
    llm = tiny()
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    hot = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], greedy)[0].token_ids
    mixed = llm.generate([[1, 2, 3], [4, 5]], [greedy, hot])
    assert mixed[0].token_ids == alone


def test_engine_on_cpu_runs_none_mode_with_reason():
    llm = tiny(mode="full")
    assert llm.mode.name == "NONE"
    assert llm.resolution.reasons
    assert llm.capture_report.num_graphs == 0


def test_decode_steps_compute_logits_and_greedy_tokens_in_the_step_itself():
    llm = tiny(dtype="bfloat16")
    reqs = [
        llm.engine.scheduler.add(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in PROMPTS
    ]
    prefill = llm.engine.scheduler.schedule()
    out = llm.engine.runner.execute(prefill)
    assert out.greedy is None  # a mixed step: the LM head runs after it
    logits = out.logits
    llm.engine.scheduler.update(prefill, logits.argmax(-1).tolist())
    decode = llm.engine.scheduler.schedule()
    assert decode.uniform_decode
    out = llm.engine.runner.execute(decode)
    logits = out.logits
    assert logits.shape == (len(decode.scheduled), llm.config.vocab_size)
    assert logits.dtype == torch.bfloat16  # the model's: no float32 cast in the step
    assert torch.equal(out.greedy, logits.argmax(-1))
    llm.engine.scheduler.abort(reqs)


def test_every_key_a_step_writes_is_within_its_new_keys_bound():
    # The bound lets the attention kernel read older keys before the K/V write ends
    # (paged_attention's new_keys): checked by brute force over a run's steps, chunked
    # prefills, mixed steps and decodes alike, eagerly on the CPU.
    llm = tiny(max_model_len=256, max_num_batched_tokens=24)
    seen = []
    backend = llm.engine.runner.backend

    class Spy:
        graph_support, applies_rope = backend.graph_support, backend.applies_rope

        def write_kv(self, *args):
            return backend.write_kv(*args)

        def __call__(self, q, k_cache, v_cache, meta, *rest):
            seen.append((meta.positions.tolist(), meta.token_req.tolist(), meta.new_keys))
            return backend(q, k_cache, v_cache, meta, *rest)

    llm.engine.runner.backend = Spy()
    prompts = [list(range(1, 40)), [5, 6, 7], list(range(2, 20))]
    llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert seen
    for positions, requests, new_keys in seen:
        assert new_keys >= 1
        for pos, req in zip(positions, requests, strict=True):
            written = [p for p, r in zip(positions, requests, strict=True) if r == req]
            if pos >= 0:  # a padding row attends to nothing
                assert all(p > pos - new_keys for p in written if p <= pos)
