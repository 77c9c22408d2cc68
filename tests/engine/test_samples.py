"""``SamplingParams.n``: several samples of one prompt, which read the first sample's
prompt blocks instead of computing them again. Each sample equals the same request run
alone (its own seed: ``SamplingParams.sample``), and greedy samples equal transformers'
greedy tokens on the same weights."""

import pytest
import torch
from hf_models import cpu_engine

from ostinato.engine import FinishReason, SamplingParams

PROMPT = [(7 * i + 3) % 200 + 5 for i in range(41)]  # 41 tokens: two full blocks of 16 shared


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        ids = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return ids[0, len(prompt) :].tolist()


def test_greedy_samples_share_the_prefill_and_equal_transformers(llama_checkpoint):
    path, hf = llama_checkpoint
    llm = cpu_engine(path)
    shared = []
    schedule = llm.engine.scheduler._shared
    llm.engine.scheduler._shared = lambda req: shared.append(schedule(req)) or shared[-1]
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, n=3))
    want = _hf_greedy(hf, PROMPT, 12)
    assert [s.token_ids for s in out.samples] == [want] * 3
    assert len(out.others) == 2 and all(s.finish_reason is FinishReason.LENGTH for s in out.samples)
    assert sum(1 for b in shared if b) == 2  # both later samples read the first one's blocks
    assert llm.free_kv_blocks == llm.num_kv_blocks - 1
    llm.close()


def test_seeded_samples_differ_and_each_equals_its_request_alone(llama_checkpoint):
    path, _ = llama_checkpoint
    llm = cpu_engine(path)
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=11, n=3)
    (out,) = llm.generate([PROMPT], params)
    got = [s.token_ids for s in out.samples]
    alone = [llm.generate([PROMPT], params.sample(i))[0].token_ids for i in range(3)]
    assert got == alone
    assert len({tuple(t) for t in got}) > 1  # each sample draws from its own seed
    assert params.sample(0).seed == 11 and params.sample(1).n == 1
    llm.close()


def test_samples_refused_where_they_cannot_be_told_apart(llama_checkpoint):
    path, _ = llama_checkpoint
    llm = cpu_engine(path)
    with pytest.raises(ValueError, match="on_token: not with n > 1"):
        llm.generate([PROMPT], SamplingParams(n=2), on_token=lambda i, t: None)
    for bad in (0, 129, 1.5, True):
        with pytest.raises(ValueError, match="n: must be an integer"):
            SamplingParams(n=bad)
    with pytest.raises(ValueError, match="sample: index"):
        SamplingParams(n=2).sample(2)
    llm.close()


def test_an_abort_ends_every_sample_of_the_request(llama_checkpoint):
    # An abort of the request's id, asked between steps, ends all three samples (the
    # id names the first; the others go with it) and frees every block.
    path, _ = llama_checkpoint
    llm = cpu_engine(path)
    inner = llm.engine.steps

    def steps():
        for i, step in enumerate(inner()):
            if i == 3:
                assert llm.abort("many")
            yield step

    llm.engine.steps = steps
    params = SamplingParams(max_tokens=40, ignore_eos=True, n=3)
    (out,) = llm.generate([PROMPT], params, request_ids=["many"])
    assert all(s.finish_reason is FinishReason.ABORT for s in out.samples)
    assert all(len(s.token_ids) < 40 for s in out.samples)
    assert not llm.abort("many")  # ended
    assert llm.free_kv_blocks == llm.num_kv_blocks - 1
    llm.close()
