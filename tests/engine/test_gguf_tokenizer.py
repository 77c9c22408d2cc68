"""A GGUF file's tokenizer built here by the ``tokenizers`` library: the same tokenizer
transformers builds from the same metadata (SmolLM2's file), which files it takes, and
what it names in a malformed one."""

import random
from dataclasses import dataclass
from typing import Any

import pytest
from smollm2 import gguf_path

from ostinato.engine.loading.gguf_file import GGUFCheckpoint
from ostinato.engine.loading.gguf_tokenizer import (
    TokenizerBuiltHere,
    TokenizerChild,
    builds_here,
    tokenizer_build,
)
from ostinato.engine.loading.tokenizer_file import load_tokenizer

TEXTS = [
    "<|im_start|>user\nThe capital of France, in 1889, was Paris.<|im_end|> ünïcödé  x",
    "  leading spaces\n\n\ttabs and\r\nCRLF   trailing  ",
    "12345678901234 3.14159 1,000,000 $5.99",
    "def f(x):\n    return x**2  # comment\n",
    "日本語のテキスト 中文 한국어 русский ελληνικά",
    "emoji 😀🎉👍🏽 family 👨\u200d👩\u200d👧",
    "<|endoftext|><|im_start|><|im_end|><repo_name><file_sep>",
    "don't you'll we've I'm he'd",
    "",
    " ",
    "a" * 300,
    "\u200b zero width \u00a0nbsp \ufeffbom x<|im_end|>y",
]
CHARS = "abcdefgXYZ 0123456789 .,;:!?'\"-\n\t()[]{}<>|/\\é漢字😀ß"


@pytest.fixture(scope="module")
def both():
    """(built here, transformers') tokenizers of SmolLM2's file."""
    checkpoint = GGUFCheckpoint(gguf_path())
    assert builds_here(checkpoint.reader.fields)
    build = TokenizerBuiltHere(checkpoint.reader.fields)
    try:
        ours = load_tokenizer(build.wait())
    finally:
        build.close()
    return ours, checkpoint.tokenizer()


def test_it_encodes_decodes_and_renders_as_transformers_does(both):
    ours, theirs = both
    rng = random.Random(0)
    texts = TEXTS + [
        "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 120))) for _ in range(200)
    ]
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(
                text, add_special_tokens=special
            ), text
    for _ in range(200):  # any ids, the special ones among them
        ids = [rng.randrange(49152) for _ in range(rng.randint(1, 30))] + [rng.randrange(17)]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "The capital of France?"},
    ]
    for prompt in (True, False):
        assert ours.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=False
        ) == theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)


def test_its_special_tokens_are_the_file_s(both):
    # Against the file's own ids (transformers 5.17 names <|im_start|> as SmolLM2's EOS,
    # 5.25 the file's <|im_end|>; the engine stops on the file's ids in either case).
    ours, _ = both
    fields = GGUFCheckpoint(gguf_path()).reader.fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    for name, key in [("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown")]:
        assert getattr(ours, name) == tokens[fields[f"tokenizer.ggml.{key}_token_id"].contents()]
    assert ours.eos_token_id == fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert ours.pad_token == tokens[fields["tokenizer.ggml.padding_token_id"].contents()]


@dataclass
class Field:
    """A GGUF reader's field, as the builder reads one."""

    value: Any

    def contents(self) -> Any:
        return self.value


def _fields(**changes: Any) -> dict[str, Field]:
    values = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab", "Ġ", "漢"],
        "tokenizer.ggml.token_type": [3, 1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 0,
    }
    values.update(changes)
    return {k: Field(v) for k, v in values.items() if v is not None}


@pytest.mark.parametrize(
    "changes",
    [
        {"tokenizer.ggml.model": "llama"},  # sentencepiece
        {"tokenizer.ggml.pre": "llama-bpe"},  # transformers splits it with its own pattern
        {"tokenizer.ggml.add_bos_token": True},
        {"tokenizer.ggml.add_space_prefix": True},
        {"tokenizer.ggml.merges": None},
    ],
)
def test_other_vocabularies_go_to_transformers_child(changes, tmp_path, monkeypatch):
    assert builds_here(_fields())
    assert not builds_here(_fields(**changes))
    started = []
    monkeypatch.setattr(TokenizerChild, "__init__", lambda self, path: started.append(path))
    assert isinstance(tokenizer_build(tmp_path / "x.gguf", _fields()), TokenizerBuiltHere)
    assert started == []
    tokenizer_build(tmp_path / "x.gguf", _fields(**changes))
    assert started == [tmp_path / "x.gguf"]


def test_a_small_vocabulary_built_here_merges_and_spells_bytes():
    build = TokenizerBuiltHere(_fields())
    try:
        tokenizer = load_tokenizer(build.wait())
    finally:
        build.close()
    assert build.folder is not None and not build.folder.exists()
    assert tokenizer.encode("ab<s>") == [3, 0]  # merged, and the control token kept whole
    assert tokenizer.eos_token == "<s>" and tokenizer.eos_token_id == 0
    assert (
        tokenizer.decode([3, 5, 0], skip_special_tokens=True) == "ab漢"
    )  # (spelled in the byte alphabet)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"tokenizer.ggml.merges": ["a b c"]}, "merge 'a b c' is not two tokens apart"),
        ({"tokenizer.ggml.eos_token_id": 99}, "eos_token_id 99 is not a token id"),
    ],
)
def test_a_malformed_vocabulary_is_named(changes, named):
    build = TokenizerBuiltHere(_fields(**changes))
    with pytest.raises(ValueError, match=named):
        build.wait()
    build.close()
