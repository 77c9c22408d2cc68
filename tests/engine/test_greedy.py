"""The chunked greedy choice equals argmax, ties included."""

import pytest
import torch

from ostinato.engine.sample.greedy import chunks_for, greedy_tokens


def test_chunks_divide_the_vocabulary_and_stay_long():
    assert chunks_for(128256) == 64 and chunks_for(49152) == 64
    assert chunks_for(151936) == 64
    assert chunks_for(1000) == 1  # 2 x 500 would leave chunks under 512
    assert chunks_for(32001) == 1  # odd
    assert chunks_for(1536) == 2


@pytest.mark.parametrize("vocab", [49152, 128256, 1536, 32001])
def test_equals_argmax_with_ties(vocab):
    g = torch.Generator().manual_seed(vocab)
    # Few distinct values: many ties, across and inside chunks.
    logits = torch.randint(0, 5, (9, vocab), generator=g).float()
    logits[3] = 0.0  # every token tied: the first wins
    logits[4, -1] = 7.0  # the maximum in the last chunk
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    smooth = torch.randn(9, vocab, generator=g)
    assert torch.equal(greedy_tokens(smooth), smooth.argmax(dim=-1))
