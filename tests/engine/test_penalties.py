"""Presence and frequency penalties: subtracted on the device from the logits of the tokens
a request has generated so far (counted step after step, its pending token read on the
device under asynchronous scheduling), checked against a direct computation, over
transformers' logits on the same weights end to end; a request without them is
untouched."""

import pytest
import torch
from hf_models import cpu_engine

from ostinato.engine import LLM, SamplingParams
from ostinato.engine.core.scheduler import Request, ScheduledRequest
from ostinato.engine.sample.adjust import OutputCounts, count_tokens, eager_adjusted, penalized

VOCAB = 50


def _scheduled(rid, output, params, pending=0):
    r = Request(rid, [1, 2, 3], params, output=list(output), num_pending=pending)
    return ScheduledRequest(r, [0], len(r.prompt) + len(output))


def _direct(logits, params, generated):
    want = logits.clone()
    for row, (p, tokens) in enumerate(zip(params, generated, strict=True)):
        for token in set(tokens):
            want[row, token] -= p.presence_penalty + p.frequency_penalty * tokens.count(token)
        for token, bias in p.logit_bias:
            want[row, token] += bias
    return want


def _adjusted(counts, step, last, logits, params, drawn=None):
    """A step as the sampler runs it: the rows brought up to date, the logits biased and
    penalized (``eager_adjusted``'s, as ``sample`` applies them), then the tokens
    ``drawn`` counted in the rows (as ``sample`` counts them)."""
    rows = counts.for_step(step, last)
    biased, penalties = eager_adjusted(logits, params, rows)
    got = penalized(biased, *penalties.operands()) if penalties is not None else biased
    if drawn is not None:
        count_tokens(rows.table, rows.device_rows, torch.tensor(drawn))
    return got


def test_penalties_and_bias_against_a_direct_computation_step_after_step():
    torch.manual_seed(0)
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 2.0}),
        SamplingParams(),  # untouched
        SamplingParams(frequency_penalty=-1.5),
        SamplingParams(presence_penalty=2.0),
    ]
    counts = OutputCounts(VOCAB, 4, torch.device("cpu"))
    # Step 1: requests 0 and 3 have a token still on the device (the last step's row
    # index[i]); their generated tokens are those recorded, then that one. The step
    # draws 20-23, which the sampler counts.
    outputs, pending = [[3, 7, 7, 9], [7, 7], [1, 1, 1], []], [1, 1, 0, 1]
    step = [
        _scheduled(i, o, p, n)
        for i, (o, p, n) in enumerate(zip(outputs, params, pending, strict=True))
    ]
    last = (torch.tensor([11, 7, 40]), {0: 1, 1: 0, 3: 2})
    generated = [[3, 7, 7, 9, 7], [], [1, 1, 1], [40]]
    logits = torch.randn(4, VOCAB)
    got = _adjusted(counts, step, last, logits, params, drawn=[20, 21, 22, 23])
    torch.testing.assert_close(got, _direct(logits, params, generated))
    assert torch.equal(got[1], logits[1])
    # Step 2: request 3 is absent (forgotten); 0's pending token is the 20 it drew, 2
    # recorded its 22. Both were counted when drawn: the pending tokens (here 5, which
    # no request drew) are not read again.
    step = [
        _scheduled(0, [3, 7, 7, 9, 7], params[0], 1),
        _scheduled(2, [1, 1, 1, 22], params[2]),
    ]
    logits = torch.randn(2, VOCAB)
    got = _adjusted(counts, step, (torch.tensor([5]), {0: 0}), logits, params[::2], [30, 31])
    want = _direct(logits, params[::2], [[3, 7, 7, 9, 7, 20], [1, 1, 1, 22]])
    torch.testing.assert_close(got, want)
    # Step 3: request 3 back with two recorded tokens: counted anew from them.
    step = [_scheduled(3, [40, 41], params[3])]
    logits = torch.randn(1, VOCAB)
    got = _adjusted(counts, step, None, logits, params[3:])
    torch.testing.assert_close(got, _direct(logits, params[3:], [[40, 41]]))


def test_a_chunk_that_draws_no_token_counts_nothing_and_a_lost_draw_is_recounted():
    counts = OutputCounts(VOCAB, 2, torch.device("cpu"))
    p = SamplingParams(frequency_penalty=1.0)
    chunk = ScheduledRequest(Request(0, [1, 2, 3], p, output=[4]), [0], 1, samples=False)
    rows = counts.for_step([chunk], None)
    assert rows.rows == [counts.scratch]  # (its drawn token is not kept: not counted)
    assert counts.counted[0] == 1
    rows = counts.for_step([_scheduled(0, [4], p)], None)
    got = rows.table[rows.device_rows]
    assert got[0, 4] == 1 and got.sum() == 1
    # The token this step drew never reached the output (here: counted, then lost):
    # the row is made anew from what the output holds.
    count_tokens(rows.table, torch.tensor(rows.rows), torch.tensor([9]))
    rows = counts.for_step([_scheduled(0, [4], p)], None)
    got = rows.table[rows.device_rows]
    assert got[0, 4] == 1 and got.sum() == 1


def test_penalties_must_be_in_openais_range():
    for name in ("presence_penalty", "frequency_penalty"):
        for bad in (2.5, -2.01, float("nan"), True, "1"):
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: bad})
    assert SamplingParams(frequency_penalty=2).frequency_penalty == 2.0
    assert not SamplingParams().penalized and SamplingParams(presence_penalty=-1).penalized


def _reference(hf, prompt, n, presence, frequency):
    """Greedy decoding over transformers' logits with the penalties applied by hand."""
    tokens = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, -1].float()
        for token in set(tokens):
            logits[token] -= presence + frequency * tokens.count(token)
        tokens.append(int(logits.argmax()))
    return tokens


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_penalized_greedy_tokens_equal_a_direct_computation(llama_checkpoint, async_scheduling):
    path, hf = llama_checkpoint
    llm = cpu_engine(path, async_scheduling=async_scheduling)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42], [7] * 12]
    penalties = [(0.0, 1.5), (1.0, 0.0), (0.5, -0.5)]
    params = [
        SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=p, frequency_penalty=f)
        for p, f in penalties
    ]
    plain = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = llm.generate([*prompts, prompts[0]], [*params, plain])  # one batch, mixed
    for prompt, (p, f), out in zip(prompts, penalties, outs[:3], strict=True):
        assert out.token_ids == _reference(hf, prompt, 20, p, f), (p, f)
    assert outs[3].token_ids == _reference(hf, prompts[0], 20, 0.0, 0.0)
    assert outs[0].token_ids != outs[3].token_ids  # (the penalty changed something)
    llm.close()


def test_the_counts_read_the_last_steps_tokens_before_the_next_step_runs(
    llama_checkpoint, monkeypatch
):
    # The last step's tokens may sit in a sampling graph's output, which shares the graph
    # pool with the step's graphs: their replay may overwrite it. Here every forward
    # overwrites them, as such a replay would; the penalized tokens stay those of a
    # direct computation (they would count garbage if read after the forward).
    path, hf = llama_checkpoint
    llm = cpu_engine(path, async_scheduling=True)
    runner = llm.engine.runner
    execute = runner.execute

    def overwriting(step, agreement=None, previous=None):
        out = execute(step, agreement, previous)
        if previous is not None and len(previous.tokens):
            previous.tokens.fill_(10**9)
        return out

    monkeypatch.setattr(runner, "execute", overwriting)
    params = SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=1.5)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    assert llm.generate([prompt], params)[0].token_ids == _reference(hf, prompt, 12, 0.0, 1.5)
    llm.close()


def test_penalties_are_refused_with_speculative_decoding():
    llm = LLM("tiny", device="cpu", max_model_len=128, progress=False, speculative="ngram")
    with pytest.raises(ValueError, match="presence_penalty / frequency_penalty: not with"):
        llm.generate([[1, 2, 3]], SamplingParams(frequency_penalty=1.0))


def test_the_rows_of_requests_gone_are_reused_and_the_table_never_moves():
    counts = OutputCounts(VOCAB, 2, torch.device("cpu"))
    table = counts.table
    p = SamplingParams(frequency_penalty=1.0)
    for rid in range(100):  # one request after another: one row of the two
        rows = counts.for_step([_scheduled(rid, [rid % VOCAB] * 3, p)], None)
        got = rows.table[rows.device_rows]
        assert got[0, rid % VOCAB] == 3 and got.sum() == 3
    assert counts.table is table and len(table) == 3  # (two rows and the scratch row)
    three = [_scheduled(rid, [1], p) for rid in range(3)]
    with pytest.raises(RuntimeError, match="more than 2 penalized requests in one step"):
        counts.for_step(three, None)
