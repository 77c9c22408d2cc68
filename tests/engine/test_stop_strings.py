"""Stop strings: found across token boundaries, the text returned ends before them, a
stream never shows one (nor text that may begin one before the next tokens say), and the
engine ends the request at the token that completes one (finish reason STOP), against
the plain answer's text on the real model's tokenizer."""

import random

import pytest
from smollm2 import gguf_path

from ostinato.engine import LLM, SamplingParams
from ostinato.engine.api.text_stream import TextStream
from ostinato.engine.core.stop_text import StopText


def letters(ids):
    """A test double of a tokenizer's decode: token i is a piece of text."""
    return "".join(PIECES[i] for i in ids)


PIECES = ["a", "bc", "d", "ef", "\n", "Us", "er", ":", "x", "yz"]


def test_a_stop_string_spanning_tokens_is_hit_at_the_token_that_completes_it():
    stop = StopText(["\nUser:"], letters)
    ids = [0, 1, 4, 5, 6, 7, 8]  # "abc\nUser:x"
    hits = [stop.hit(ids[:n]) for n in range(1, len(ids) + 1)]
    assert hits == [False, False, False, False, False, True, True]
    assert stop.cut(letters(ids)) == "abc"
    assert stop.cut("no stop here") == "no stop here"
    with pytest.raises(ValueError, match="stop"):
        StopText([""], letters)


def test_a_stream_never_shows_a_stop_string_nor_what_may_begin_one():
    # every split of random token streams into pushes: the pieces and the rest add up to
    # the text before the first stop string, and no piece ends in text that begins one
    # unless more text proved it does not
    rng = random.Random(0)
    stops = ["\nUser:", "yzx", "d"]
    for _ in range(300):
        ids = [rng.randrange(len(PIECES)) for _ in range(rng.randint(1, 15))]
        chosen = rng.sample(stops, rng.randint(1, 3))
        stream = TextStream(letters, StopText(chosen, letters))
        pieces, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 3)
            piece = stream.push(ids[i : i + n])
            pieces.append(piece or "")
            i += n
            shown = "".join(pieces)
            assert not any(s in shown for s in chosen)
        whole = "".join(pieces) + stream.rest()
        assert whole == StopText(chosen, letters).cut(letters(ids)), (ids, chosen)


def test_stop_must_be_non_empty_strings():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    for bad in ([""], [1], [None], ""):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=bad)


def test_stop_strings_need_a_tokenizer():
    llm = LLM("tiny", device="cpu", max_model_len=64, progress=False)
    with pytest.raises(ValueError, match="stop: stop strings need the model's tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(stop=["x"]))


def test_the_engine_ends_a_request_where_its_text_reaches_a_stop_string():
    gguf_path()
    llm = LLM(device="cpu", max_model_len=256, max_num_seqs=4, progress=False)
    prompt = "The history of the Roman Empire begins with"
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=40))
    text = plain.text
    # a stop string that spans two tokens of the plain answer, well inside it
    pieces = [llm.decode(plain.token_ids[:n]) for n in range(1, len(plain.token_ids) + 1)]
    n = next(i for i in range(5, len(pieces)) if len(pieces[i]) - len(pieces[i - 1]) >= 2)
    start = len(pieces[n - 1]) - 2
    stop = text[start : len(pieces[n]) - 1]
    assert text.find(stop) == start  # its first occurrence
    (got,) = llm.generate([prompt], SamplingParams(max_tokens=40, stop=[stop]))
    assert got.finish_reason.value == "stop"
    assert got.text == text[:start]
    assert got.token_ids == plain.token_ids[: len(got.token_ids)]
    assert stop in llm.decode(got.token_ids) and stop not in llm.decode(got.token_ids[:-1])
    # batched with others and next to a request without stop strings: the same
    outs = llm.generate(
        [prompt, "Once upon a time"],
        [SamplingParams(max_tokens=40, stop=[stop, "zzz"]), SamplingParams(max_tokens=40)],
    )
    assert outs[0].text == got.text and outs[0].token_ids == got.token_ids
