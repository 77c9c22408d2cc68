"""Log probabilities (``SamplingParams(logprobs=k)``): each generated token's, and its k
most likely alternatives', equal the log-softmax of transformers' logits on the same
weights (float32, CPU), greedy or sampled, batched with requests that ask for none."""

import pytest
import torch
from hf_models import cpu_engine

from ostinato.engine import LLM, SamplingParams, TokenLogprob


def _reference(hf, prompt, tokens):
    """transformers' log-softmax at each generated position ([len(tokens), vocab])."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def _check(hf, prompt, out, k):
    ref = _reference(hf, prompt, out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    for t, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert isinstance(lp, TokenLogprob) and lp.token_id == token
        assert lp.logprob == pytest.approx(ref[t, token].item(), abs=1e-4)
        assert len(lp.top) == k
        want = ref[t].topk(k)
        assert [i for i, _ in lp.top] == want.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(want.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_logprobs_equal_transformers_log_softmax(llama_checkpoint, async_scheduling):
    path, hf = llama_checkpoint
    llm = cpu_engine(path, async_scheduling=async_scheduling)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42], [7] * 12, [3, 4]]
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0, temperature=1.0, seed=3),
        SamplingParams(max_tokens=12, ignore_eos=True),  # asks for none
        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=20, top_p=0.5, temperature=0.7),
    ]
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        if p.logprobs is None:
            assert out.logprobs is None
        else:
            _check(hf, prompt, out, p.logprobs)
    (alone,) = llm.generate([prompts[0]], params[0])
    assert alone.token_ids == outs[0].token_ids
    assert [lp.logprob for lp in alone.logprobs] == pytest.approx(
        [lp.logprob for lp in outs[0].logprobs], abs=1e-5
    )
    llm.close()


def test_logprobs_are_checked_and_refused_with_speculative_decoding():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
    llm = LLM("tiny", device="cpu", max_model_len=128, progress=False, speculative="ngram")
    with pytest.raises(ValueError, match="logprobs: not with speculative decoding"):
        llm.generate([[1, 2, 3]], SamplingParams(logprobs=2))


def test_a_steps_entries_take_each_requests_own_count_of_the_graphs_columns():
    # A sampling graph's copy holds 20 alternatives a row whatever the step asked; each
    # request gets its own count, most likely first, and one that asked none gets None.
    from ostinato.engine.sample.logprobs import StepLogprobs

    chosen = torch.tensor([-0.5, -1.0, -2.0, -3.0])
    ids = torch.arange(80).reshape(4, 20)
    values = -torch.arange(80, dtype=torch.float32).reshape(4, 20) / 10
    step = StepLogprobs(chosen, ids, values)
    params = [SamplingParams(logprobs=k) for k in (5, None, 2, 0)]
    got = step.entries(params, [7, 8, 9, 10])
    assert got[1] is None
    for entry, row, k, token in ((got[0], 0, 5, 7), (got[2], 2, 2, 9), (got[3], 3, 0, 10)):
        assert entry.token_id == token and entry.logprob == chosen[row].item()
        assert entry.top_ids == tuple(ids[row, :k].tolist())
        assert entry.top_logprobs == tuple(values[row, :k].tolist())
    nobody = [SamplingParams(), SamplingParams()]
    assert step.entries(nobody, [1, 2]) == [None, None]
    # Every row asking as many (the usual step, made in one pass) gives what the row-by-row
    # path gives those rows, and a token list of another length is refused.
    three = SamplingParams(logprobs=3)
    alike = step.entries([three] * 4, [0, 1, 2, 3])
    mixed = step.entries([three, three, three, SamplingParams(logprobs=2)], [0, 1, 2, 3])
    assert alike[:3] == mixed[:3] and len(alike[3].top_ids) == 3
    with pytest.raises(ValueError):
        step.entries([three] * 4, [0, 1, 2])


def test_a_landing_fits_steps_of_its_columns_and_types_and_no_more_rows():
    from ostinato.engine.sample.logprobs import StepLogprobs

    def step(rows, k, ids=torch.long):
        return StepLogprobs(
            torch.zeros(rows), torch.zeros(rows, k, dtype=ids), torch.zeros(rows, k)
        )

    landing = step(8, 20)
    assert landing.fits(step(8, 20)) and landing.fits(step(3, 20))
    assert not landing.fits(step(9, 20))  # more rows
    assert not landing.fits(step(4, 5))  # other columns (an eager step's k)
    assert not landing.fits(step(4, 20, torch.int32))
