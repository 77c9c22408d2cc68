"""``StepRows``: a step's per-row sampling values, kept for a steady decode, equal to
what each request's parameters say (``sample.rows``)."""

import random

import numpy as np
import pytest
import torch

from ostinato.engine.core.params import SamplingParams
from ostinato.engine.sample.adjust import OutputCounts
from ostinato.engine.sample.rows import StepRows
from ostinato.engine.sample.sampler import _row_keys, row_keys_and_mask, row_keys_array
from ostinato.engine.sample.step_sampler import StepSampler

M64 = (1 << 64) - 1


def _splitmix_key(seed: int, index: int) -> int:
    """The reference: SplitMix64's finaliser of ``seed * golden + index`` on Python
    integers (exact, masked to 64 bits at each step), its low 32 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + index) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def test_row_keys_array_is_the_integer_mix_bit_for_bit():
    rng = random.Random(0)
    pairs = [(rng.randrange(2**63), rng.randrange(1 << 40)) for _ in range(2000)]
    pairs += [(0, 0), (2**63 - 1, 0), (2**63 - 1, (1 << 40) - 1)]
    seeds = np.array([s for s, _ in pairs], dtype=np.uint64)
    indices = np.array([i for _, i in pairs], dtype=np.uint64)
    want = [_splitmix_key(s, i) for s, i in pairs]
    assert row_keys_array(seeds, indices).tolist() == want
    assert _row_keys(pairs) == want and _row_keys([]) == []
    # any Python integers (the public sampler's seeds): taken modulo 2**64, as the mix is
    wide = [(rng.randrange(-(2**70), 2**70), rng.randrange(-(2**66), 2**66)) for _ in range(500)]
    assert _row_keys(wide) == [_splitmix_key(s, i) for s, i in wide]


def test_rows_say_what_each_requests_parameters_say():
    params = [
        SamplingParams(),  # greedy
        SamplingParams(temperature=0.7, top_p=0.9, seed=5, logprobs=3),
        SamplingParams(temperature=0, seed=9),  # greedy: its seed draws nothing
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25,
                       logit_bias={3: 1.5}, logprobs=7),
    ]  # fmt: skip
    rows = StepRows.of(params)
    expected = [[0, 0.7, 0, 1.0], [1, 0.9, 1, 1], [0, 0, 0, 0.5], [0, 0, 0, 0.25]]
    np.testing.assert_array_equal(rows.floats, np.array(expected, dtype=np.float32))
    assert rows.seeded_rows.tolist() == [0, 1, 0, 0]
    assert (rows.all_greedy, rows.adjusted, rows.seeded, rows.cut) == (False, True, True, True)
    assert rows.logprobs == 7
    assert rows.bias == ((), (), (), ((3, 1.5),))
    indices = [11, 12, 13, 14]
    seeded = [(5, 12) if i == 1 else None for i in range(4)]
    keys, mask = row_keys_and_mask(seeded)
    assert rows.keys(indices).tolist() == keys and rows.seeded_rows.tolist() == mask
    plain = StepRows.of([SamplingParams(temperature=0.5)] * 3)
    assert (plain.adjusted, plain.seeded, plain.cut, plain.logprobs) == (False, False, False, None)
    assert plain.keys([1, 2, 3]).tolist() == [0, 0, 0]
    # a seeded step without an index a row: named
    with pytest.raises(ValueError, match="seeded requests need the index of each token"):
        rows.keys([11, 12])


def test_a_steady_batch_keeps_its_rows_and_any_change_makes_them_anew():
    sampler = StepSampler(torch.Generator(), torch.device("cpu"), OutputCounts(8, 4, "cpu"))
    a, b = SamplingParams(temperature=0.5), SamplingParams(temperature=0.5)
    first = sampler.rows([a, b])
    assert sampler.rows([a, b]) is first  # the same requests' parameters, in order
    for other in ([b, a], [a], [a, b, a], [a, SamplingParams(temperature=0.5)]):
        made = sampler.rows(other)
        assert made is not first and made.params == tuple(other)
        first = made
