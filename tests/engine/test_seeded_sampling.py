"""Seeded sampling: a request with ``SamplingParams(seed=...)`` draws from its seed alone,
so its tokens are the same alone or batched with any others, call after call, whatever
the engine's generator has drawn; another seed draws others. And a request's
``logit_bias``, added to its own logits only, greedy or sampled."""

import random

import pytest
import torch

from ostinato.engine import LLM, SamplingParams
from ostinato.engine.sample.sampler import _row_keys, sample, seeded_races

VOCAB = 1000


def test_a_seeded_row_depends_on_its_logits_and_seed_alone():
    torch.manual_seed(0)
    row = torch.randn(VOCAB) * 3
    others = torch.randn(5, VOCAB) * 3
    ones = torch.ones(6)
    got = set()
    for batch_seed in range(4):  # other rows and other generator states
        logits = torch.cat([others[: batch_seed + 1], row[None]])
        n = logits.shape[0]
        generator = torch.Generator().manual_seed(100 + batch_seed)
        seeded = [None] * (n - 1) + [(7, 42)]
        tokens = sample(logits, ones[:n], ones[:n], generator, False, seeded)
        got.add(int(tokens[-1]))
    assert len(got) == 1
    draws = {
        int(sample(row[None], ones[:1], ones[:1], None, False, [(seed, 42)])[0])
        for seed in range(40)
    }
    assert len(draws) > 5  # other seeds, other tokens (at temperature 1 over 1000 ids)
    index_draws = {
        int(sample(row[None], ones[:1], ones[:1], None, False, [(7, i)])[0]) for i in range(40)
    }
    assert len(index_draws) > 5  # each token of a sequence draws anew


def test_seeded_draws_follow_the_distribution():
    # 4000 seeded draws from 8 tokens, over seeds and over indices of one seed: each
    # token's share within 4 sigma of its probability; the races are Exp(1).
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    n = 4000
    keys = [(s, 3) for s in range(n // 2)] + [(5, i) for i in range(n // 2)]
    ones = torch.ones(n)
    tokens = sample(probs.log().expand(n, 8), ones, ones, None, False, keys)
    share = torch.bincount(tokens, minlength=8) / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((share - probs).abs() < 4 * sigma).all(), share
    race = seeded_races(torch.tensor(_row_keys(keys[:200])), 1000)
    assert race.shape == (200, 1000) and bool((race > 0).all())
    assert abs(race.mean().item() - 1) < 0.01 and abs(race.var().item() - 1) < 0.03
    again = seeded_races(torch.tensor(_row_keys(keys[100:101])), 1000)
    assert torch.equal(again[0], race[100])  # a row depends on its key alone


def test_seed_must_be_a_non_negative_int():
    for bad in (-1, 1.5, True, 1 << 63):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=bad)
    assert SamplingParams(seed=0).seed == 0


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", max_model_len=128, max_num_seqs=4, progress=False, seed=1)


def test_a_seeded_request_gets_the_same_tokens_alone_batched_and_again(llm):
    prompt = [5, 6, 7, 8, 9, 10]
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    (alone,) = llm.generate([prompt], seeded)
    others = [[11, 12, 13], [3] * 20, [40, 41]]
    mixed = [
        SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=1.0, seed=99, ignore_eos=True),
        SamplingParams(max_tokens=9, ignore_eos=True),
    ]
    batched = llm.generate(
        [others[0], prompt, others[1], others[2]], [mixed[0], seeded, *mixed[1:]]
    )
    again = llm.generate([prompt], seeded)
    assert batched[1].token_ids == alone.token_ids == again[0].token_ids
    (other_seed,) = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=5))
    assert other_seed.token_ids != alone.token_ids
    (unseeded,) = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0))
    (unseeded_again,) = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0))
    assert unseeded.token_ids != unseeded_again.token_ids  # the engine's generator moves on


def test_seed_is_refused_with_speculative_decoding():
    llm = LLM("tiny", device="cpu", max_model_len=128, progress=False, speculative="ngram")
    with pytest.raises(ValueError, match="seed: not with speculative decoding"):
        llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=3))


def test_a_logit_bias_moves_its_request_only(llm):
    prompt = [5, 6, 7, 8, 9, 10]
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    forced = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={42: 100})
    banned = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={plain.token_ids[0]: -100})
    hot = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, logit_bias={42: 100})
    outs = llm.generate(
        [prompt] * 4, [forced, banned, hot, SamplingParams(max_tokens=6, ignore_eos=True)]
    )
    assert outs[0].token_ids == [42] * 6 and outs[2].token_ids == [42] * 6
    assert outs[1].token_ids[0] != plain.token_ids[0]
    assert outs[3].token_ids == plain.token_ids  # no bias: as alone, untouched
    with pytest.raises(ValueError, match="logit_bias: token id 100000 outside"):
        llm.generate([prompt], SamplingParams(logit_bias={100000: 1}))
    for bad in ({-1: 1}, {3: 101}, {3: float("nan")}, [(1,)]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_the_nucleus_keeps_a_token_where_the_mass_above_it_is_below_top_p():
    # Against its definition, token by token: kept where the mass of the strictly more
    # likely tokens is below top_p, so tokens tied at the nucleus's edge stay together
    # (a sort keeps them in whatever order it leaves ties); rows with many ties.
    from ostinato.engine.sample.sampler import nucleus

    g = torch.Generator().manual_seed(4)
    for _ in range(50):
        levels = torch.rand(6, generator=g)
        probs = levels[torch.randint(0, 6, (5, 40), generator=g)]  # five rows of ties
        probs /= probs.sum(dim=-1, keepdim=True)
        top_ps = torch.rand(5, generator=g) * 0.9 + 0.05
        above = (probs[:, None, :] > probs[:, :, None]).float() @ probs[:, :, None]
        want = above.squeeze(-1) < top_ps[:, None]
        assert torch.equal(nucleus(probs, top_ps), want)


def test_row_keys_of_a_step_are_each_rows_own_and_zero_where_unseeded():
    # One pass over the seeded rows (row_keys_and_mask): each key that row's alone.
    from ostinato.engine.sample.sampler import row_keys_and_mask

    r = random.Random(4)
    draw = lambda: (r.randrange(-(2**70), 2**70), r.randrange(10**6))  # noqa: E731
    seeded = [draw() if i % 3 else None for i in range(40)]
    keys, mask = row_keys_and_mask(seeded)
    assert keys == [_row_keys([s])[0] if s is not None else 0 for s in seeded]
    assert mask == [int(s is not None) for s in seeded]
    assert row_keys_and_mask([None, None]) == ([0, 0], [0, 0])
