"""TextStream: the pieces it returns add up to the text of the whole stream, whatever the
chunking, on SmolLM2's tokenizer and text with multi-byte characters."""

import random

import pytest
from smollm2 import gguf_path

from ostinato.engine.api.text_stream import TextStream

TEXTS = [
    "The Roman Empire began in 27 BC, when Octavian became Augustus.",
    "Crème brûlée, naïve café — 東京タワー は 333 m; emoji 🎉🚀 and ∑ x² ≠ ∞.",
    "def f(n):\n    return [i ** 2 for i in range(n)]  # squares\n\n\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    from ostinato.engine.loading.source import open_model

    gguf_path()
    return open_model(None).tokenizer


@pytest.mark.parametrize("seed", range(4))
def test_pieces_add_up_to_the_whole_text(tokenizer, seed):
    rng = random.Random(seed)

    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        stream, pieces, i = TextStream(decode), [], 0
        while i < len(ids):
            n = rng.randint(1, 3)
            piece = stream.push(ids[i : i + n])
            assert piece is None or "\ufffd" not in piece
            pieces.append(piece or "")
            i += n
        assert "".join(pieces) + stream.rest() == decode(ids)


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    # A decoder over raw bytes: token i is byte i of the UTF-8 text.
    data = "é🎉".encode()

    def decode(ids):
        return bytes(data[i] for i in ids).decode("utf-8", errors="replace")

    stream = TextStream(decode)
    assert stream.push([0]) is None  # the first byte of 'é'
    assert stream.push([1]) == "é"
    assert [stream.push([i]) for i in (2, 3, 4)] == [None, None, None]
    assert stream.push([5]) == "🎉" and stream.rest() == ""
