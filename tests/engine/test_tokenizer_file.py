"""The tokenizer of a model-cache entry, read without transformers, against transformers
reading the same folder: ids, text and chat prompts (SmolLM2-135M-Instruct's entry)."""

import json
import subprocess
import sys

import pytest
from smollm2 import PROMPTS, gguf_path

from ostinato.engine.loading.model_cache import ModelCache
from ostinato.engine.loading.source import open_model
from ostinato.engine.loading.tokenizer_file import TokenizerFile, load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And of Spain? ünïcödé 🎉"},
    ],
]
TEXTS = [*PROMPTS, "  two  spaces <|im_end|> and a special token", "émoji 🎉\n\ttab"]


@pytest.fixture(scope="module")
def entry(tmp_path_factory):
    """SmolLM2's tokenizer folder in a fresh model cache, and transformers' tokenizer of it."""
    transformers = pytest.importorskip("transformers")
    cache = ModelCache(tmp_path_factory.mktemp("cache"))
    open_model(gguf_path(), cache=cache)
    folder = cache.lookup(gguf_path(), __import__("torch").float32).tokenizer_dir
    return folder, transformers.AutoTokenizer.from_pretrained(str(folder))


def test_ids_and_text_equal_transformers(entry):
    folder, theirs = entry
    ours = load_tokenizer(folder)
    assert isinstance(ours, TokenizerFile)
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip
                )


def test_chat_prompts_equal_transformers(entry):
    folder, theirs = entry
    ours = load_tokenizer(folder)
    assert ours.chat_template == theirs.chat_template
    for messages in CONVERSATIONS:
        for gen in (True, False):
            kw = dict(add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(messages, **kw) == theirs.apply_chat_template(
                messages, **kw
            )


def test_what_it_cannot_reproduce_is_left_to_transformers(entry, tmp_path):
    folder, _ = entry
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((folder / name).read_text())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert load_tokenizer(tmp_path) is not None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "clean_up_tokenization_spaces": True})
    )
    import transformers

    # transformers 5 ignores the flag for BPE tokenizers (SmolLM2's); 4 applies it.
    cleans = int(transformers.__version__.split(".")[0]) < 5
    assert (load_tokenizer(tmp_path) is None) == cleans
    if not cleans:
        theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
        ids = theirs.encode("Hello , world . It 's here !")
        assert load_tokenizer(tmp_path).decode(ids) == theirs.decode(ids)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": "{% generation %}x{% endgeneration %}"})
    )
    assert load_tokenizer(tmp_path) is None  # needs transformers' own jinja extension
    (tmp_path / "tokenizer.json").unlink()
    assert load_tokenizer(tmp_path) is None


def test_a_cache_hit_imports_no_transformers(entry, tmp_path):
    folder, _ = entry
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from ostinato.engine.loading.tokenizer_file import load_tokenizer\n"
        f"tok = load_tokenizer(Path({str(folder)!r}))\n"
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)\n"
        "assert 'transformers' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
