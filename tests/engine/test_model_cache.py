"""The model cache: a GGUF file converted once, then mapped; and every way an entry can
go bad (corrupt, truncated, stale, unwritable, two writers at once)."""

import json
import logging
import multiprocessing as mp
import os
import threading
from typing import Any

import pytest
import torch
from smollm2 import gguf_path

from ostinato.cache_root import ENV_VAR, default_cache_root
from ostinato.engine.loading import source as source_module
from ostinato.engine.loading.model_cache import MANIFEST, WEIGHTS, ModelCache
from ostinato.engine.loading.source import open_model
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.model.presets import SHAPES

CONFIG = ModelConfig.from_hf(SHAPES["tiny"])


def _fake_source(tmp_path, name="model.gguf", payload=b"GGUF" + b"\0" * 64):
    path = tmp_path / name
    path.write_bytes(payload)
    return path


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(8, 4, generator=g), "b.bias": torch.randn(3, generator=g)}


def _store(cache, src, dtype=torch.float32, tokenizer=None):
    return cache.store(src, dtype, CONFIG, (2,), _tensors(), tokenizer)


def _entries(cache):
    return sorted(p.name for p in (cache.root / "models").iterdir())


def test_miss_then_hit_returns_what_was_stored(tmp_path):
    cache, src = ModelCache(tmp_path / "cache"), _fake_source(tmp_path)
    assert cache.lookup(src, torch.float32) is None
    folder = _store(cache, src)
    hit = cache.lookup(src, torch.float32)
    assert hit is not None and hit.folder == folder
    assert hit.config == CONFIG and hit.eos_token_ids == (2,)
    from safetensors.torch import load_file

    stored = load_file(str(hit.weights))
    for name, t in _tensors().items():
        assert torch.equal(stored[name], t)
    assert cache.lookup(src, torch.bfloat16) is None  # another dtype is another entry


@pytest.mark.parametrize(
    "damage, named",
    [
        ("flip", "corrupt"),
        ("truncate", "truncated"),
        ("version", "stale"),
        ("manifest", "incomplete"),
    ],
)
def test_a_bad_entry_is_named_removed_and_rebuilt(tmp_path, caplog, damage, named):
    cache, src = ModelCache(tmp_path / "cache"), _fake_source(tmp_path)
    folder = _store(cache, src)
    weights, manifest = folder / WEIGHTS, folder / MANIFEST
    if damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-3] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-10])
    elif damage == "version":
        doc = json.loads(manifest.read_text())
        doc["key"]["ostinato"] = "0.0.0-old"
        manifest.write_text(json.dumps(doc))
    else:
        manifest.unlink()
    with caplog.at_level(logging.WARNING):
        assert cache.lookup(src, torch.float32) is None
    assert named in caplog.text and str(folder) in caplog.text
    assert not folder.exists()
    assert _store(cache, src) == folder and cache.lookup(src, torch.float32) is not None


def test_a_flip_in_any_piece_of_a_checksum_is_found(tmp_path, monkeypatch):
    # The checksum is one CRC-32 a piece, computed on threads: a byte changed in a middle
    # piece fails it as one in the last does, and a piece's CRC is zlib's of its bytes.
    import zlib

    from ostinato.engine.loading import model_cache

    monkeypatch.setattr(model_cache, "PIECE_BYTES", 1000)
    path = tmp_path / "blob"
    data = bytearray(os.urandom(4500))
    path.write_bytes(bytes(data))
    whole = model_cache.file_checksum(path)
    pieces = [f"{zlib.crc32(data[i : i + 1000]):08x}" for i in range(0, 4500, 1000)]
    assert whole == "crc32:" + ",".join(pieces)
    data[2345] ^= 1
    path.write_bytes(bytes(data))
    assert model_cache.file_checksum(path) != whole


def test_a_changed_source_misses_and_its_old_entry_is_pruned(tmp_path):
    cache, src = ModelCache(tmp_path / "cache"), _fake_source(tmp_path)
    old = _store(cache, src)
    src.write_bytes(b"GGUF" + b"\1" * 64)  # same size, new content and mtime
    os.utime(src, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns + 10**9))
    assert cache.lookup(src, torch.float32) is None
    new = _store(cache, src)
    assert new != old and _entries(cache) == [new.name]


def test_an_unwritable_cache_warns_and_leaves_nothing_behind(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    src = _fake_source(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert _store(ModelCache(blocker), src) is None
    assert "cannot write the model cache" in caplog.text


def test_a_full_disk_warns_and_removes_the_partial_entry(tmp_path, caplog, monkeypatch):
    import safetensors.torch

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    cache, src = ModelCache(tmp_path / "cache"), _fake_source(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert _store(cache, src) is None
    assert "No space left" in caplog.text and _entries(cache) == []


def _write_once(root, src, barrier):
    barrier.wait()
    ModelCache(root).store(src, torch.float32, CONFIG, (2,), _tensors(), None)


def test_concurrent_writers_leave_one_valid_entry(tmp_path):
    root, src = tmp_path / "cache", _fake_source(tmp_path)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_write_once, args=(root, src, barrier)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    cache = ModelCache(root)
    assert len(_entries(cache)) == 1  # no temporary folder left either
    assert cache.lookup(src, torch.float32) is not None


def test_where_the_cache_lives(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert default_cache_root() == tmp_path / "env"
    assert ModelCache.from_arg(None).root == tmp_path / "env"
    assert ModelCache.from_arg(tmp_path / "arg").root == tmp_path / "arg"
    assert ModelCache.from_arg(False) is None
    monkeypatch.delenv(ENV_VAR)
    assert default_cache_root().name == "ostinato"
    with pytest.raises(TypeError, match="cache_dir"):
        ModelCache.from_arg(3)


def _weights(source):
    with torch.device("meta"):
        model = DecoderModel(source.config)
    model = model.to_empty(device="cpu")
    source.load(model)
    return model.state_dict()


def test_smollm2_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    path = gguf_path()
    cache = ModelCache(tmp_path / "cache")
    converted = open_model(path, cache=cache)
    assert cache.lookup(path, torch.float32) is not None

    def no_parsing(*args, **kwargs):
        raise AssertionError("a cache hit parsed the GGUF file")

    monkeypatch.setattr(source_module, "GGUFCheckpoint", no_parsing)
    cached = open_model(path, cache=cache)
    assert cached.config == converted.config
    assert cached.eos_token_ids == converted.eos_token_ids == (2,)
    text = "The capital of France is Paris. <|im_end|>"
    assert cached.tokenizer.encode(text) == converted.tokenizer.encode(text)
    assert cached.tokenizer.chat_template == converted.tokenizer.chat_template
    ours, theirs = _weights(cached), _weights(converted)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_gguf_file_is_parsed_once_per_load(tmp_path, monkeypatch):
    import gguf

    path = gguf_path()
    made = []
    original = gguf.GGUFReader

    class Counting(original):
        def __init__(self, *args, **kwargs):
            made.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    source = open_model(path, cache=None)
    assert source.tokenizer is not None and len(made) == 1


def held_back(real: Any) -> tuple[threading.Event, Any]:
    """``real`` made to wait for the event returned beside it before it runs."""
    release = threading.Event()

    def slow(*args: Any) -> Any:
        assert release.wait(60)
        return real(*args)

    return release, slow


def test_a_conversion_opened_later_hands_its_tokenizer_and_entry_over_at_finish(
    tmp_path, monkeypatch
):
    from ostinato.engine.loading.gguf_tokenizer import TokenizerBuiltHere

    path, cache = gguf_path(), ModelCache(tmp_path / "cache")
    release, slow = held_back(TokenizerBuiltHere.wait)
    monkeypatch.setattr(TokenizerBuiltHere, "wait", slow)
    source = open_model(path, cache=cache, later=True)
    # The weights are ready; the tokenizer (built on a thread) and the entry come later.
    assert source.load is not None and source.tokenizer is None and not source.pending.done()
    assert not (cache.root / "models").exists() or not _entries(cache)
    release.set()
    tokenizer = source.finish()
    assert tokenizer is not None and source.tokenizer is tokenizer and source.pending is None
    assert cache.lookup(path, torch.float32) is not None
    assert source.finish() is tokenizer  # again: the same, at once


def test_a_cached_model_opened_later_reads_its_tokenizer_beside_the_start(tmp_path, monkeypatch):
    path, cache = gguf_path(), ModelCache(tmp_path / "cache")
    converted = open_model(path, cache=cache).tokenizer  # (the conversion, then the hit)
    real = source_module._folder_tokenizer
    release, slow = held_back(real)
    monkeypatch.setattr(source_module, "_folder_tokenizer", slow)
    source = open_model(path, cache=cache, later=True)
    assert source.load is not None and source.tokenizer is None and not source.pending.done()
    release.set()
    tokenizer = source.finish()
    assert tokenizer is not None and source.pending is None
    text = "The capital of France is Paris."
    assert tokenizer.encode(text) == converted.encode(text)
    monkeypatch.setattr(source_module, "_folder_tokenizer", real)
    assert open_model(path, cache=cache).tokenizer is not None  # (not later: read at once)


def _child_builds(monkeypatch):
    """SmolLM2's tokenizer made by the child, as a file's the module does not build is."""
    from ostinato.engine.loading import gguf_tokenizer

    monkeypatch.setattr(gguf_tokenizer, "builds_here", lambda fields: False)


def test_the_child_process_s_tokenizer_is_the_one_transformers_builds_here(tmp_path, monkeypatch):
    from ostinato.engine.loading.gguf_file import GGUFCheckpoint

    _child_builds(monkeypatch)
    path = gguf_path()
    here = GGUFCheckpoint(path).tokenizer()
    child = open_model(path, cache=ModelCache(tmp_path / "cache")).tokenizer
    text = "<|im_start|>user\nThe capital of France, in 1889, was Paris.<|im_end|> ünïcödé  x"
    assert child.encode(text) == here.encode(text)
    ids = here.encode(text)
    assert child.decode(ids) == here.decode(ids)
    messages = [{"role": "user", "content": "Hi there"}]
    assert child.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == here.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _failing_child(monkeypatch):
    from ostinato.engine.loading.gguf_tokenizer import TokenizerChild

    _child_builds(monkeypatch)
    monkeypatch.setattr(TokenizerChild, "module", "ostinato.no_such_module")


def test_a_failed_child_is_named_and_the_tokenizer_built_here(tmp_path, monkeypatch, caplog):
    _failing_child(monkeypatch)
    path, cache = gguf_path(), ModelCache(tmp_path / "cache")
    with caplog.at_level(logging.WARNING):
        source = open_model(path, cache=cache)
    assert "exited with status 1" in caplog.text and "no_such_module" in caplog.text
    assert source.tokenizer is not None and source.tokenizer.encode("Paris")
    hit = cache.lookup(path, torch.float32)
    assert hit is not None and hit.tokenizer_dir is not None


def test_a_malformed_vocabulary_built_here_is_named_and_transformers_builds_it(
    tmp_path, monkeypatch, caplog
):
    from ostinato.engine.loading import gguf_tokenizer

    def malformed(fields):
        raise ValueError("GGUF tokenizer: merge 'a b c' is not two tokens apart")

    monkeypatch.setattr(gguf_tokenizer, "byte_level_files", malformed)
    path, cache = gguf_path(), ModelCache(tmp_path / "cache")
    with caplog.at_level(logging.WARNING):
        source = open_model(path, cache=cache)
    assert "merge 'a b c' is not two tokens apart" in caplog.text
    assert "building the tokenizer with transformers instead" in caplog.text
    assert source.tokenizer is not None and source.tokenizer.encode("Paris")
    hit = cache.lookup(path, torch.float32)
    assert hit is not None and (hit.tokenizer_dir / "tokenizer.json").is_file()


def test_without_transformers_a_first_start_has_no_tokenizer_and_its_entry_none(
    tmp_path, monkeypatch
):
    from ostinato.engine.loading.gguf_tokenizer import TokenizerChild

    _child_builds(monkeypatch)
    monkeypatch.setattr(TokenizerChild, "module", "no_transformers_child")
    path, cache = gguf_path(), ModelCache(tmp_path / "cache")
    source = open_model(path, cache=cache)
    assert source.tokenizer is None and source.eos_token_ids == (2,)
    hit = cache.lookup(path, torch.float32)
    assert hit is not None and hit.tokenizer_dir is None


def test_a_cache_that_cannot_be_written_still_gives_the_tokenizer(tmp_path, caplog):
    path = gguf_path()
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING):
        source = open_model(path, cache=ModelCache(blocked), later=True)
        tokenizer = source.finish()
    assert "cannot write the model cache" in caplog.text
    assert tokenizer is not None and tokenizer.encode("Paris")


def test_a_first_start_stops_on_text_and_a_failed_tokenizer_fails_the_start(tmp_path, monkeypatch):
    from ostinato.engine import LLM, SamplingParams
    from ostinato.engine.loading.gguf_file import GGUFCheckpoint

    path = gguf_path()
    # A first start (empty model cache): its tokenizer arrives at the end of the build,
    # and the stop strings, which decode with it, work from the first request.
    llm = LLM(str(path), device="cpu", cache_dir=str(tmp_path / "a"), num_blocks=80)
    plain = llm.generate(["The capital of France is"], SamplingParams(max_tokens=12))[0]
    stop = plain.text.strip().split()[1]
    cut = llm.generate(["The capital of France is"], SamplingParams(max_tokens=12, stop=[stop]))[0]
    assert cut.finish_reason.value == "stop" and stop not in cut.text
    assert plain.text.startswith(cut.text)

    def broken(self):
        raise RuntimeError("tokenizer conversion failed")

    # The child fails, then the conversion in this process too: the start fails.
    _failing_child(monkeypatch)
    monkeypatch.setattr(GGUFCheckpoint, "tokenizer", broken)
    with pytest.raises(RuntimeError, match="tokenizer conversion failed"):
        LLM(str(path), device="cpu", cache_dir=str(tmp_path / "b"), num_blocks=80)
    assert not list((tmp_path / "b").rglob(".tmp-*"))  # no partial entry left


def test_a_first_start_of_smollm2_starts_no_child_and_imports_no_transformers(tmp_path):
    # Its byte-level vocabulary is built here (gguf_tokenizer); the entry it writes holds
    # the tokenizer a later start reads.
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path\n"
        "from ostinato.engine.loading import gguf_tokenizer\n"
        "from ostinato.engine.loading.model_cache import ModelCache\n"
        "from ostinato.engine.loading.source import open_model\n"
        "def refused(self, path): raise AssertionError('a child was started')\n"
        "gguf_tokenizer.TokenizerChild.__init__ = refused\n"
        f"cache = ModelCache(Path({str(tmp_path / 'cache')!r}))\n"
        f"path = Path({str(gguf_path())!r})\n"
        "source = open_model(path, cache=cache)\n"
        "assert source.tokenizer.encode('Paris') and cache.lookup(path, source.dtype)\n"
        "assert 'transformers' not in sys.modules, 'imported transformers'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    hit = ModelCache(tmp_path / "cache").lookup(gguf_path(), torch.float32)
    assert hit is not None and (hit.tokenizer_dir / "tokenizer.json").is_file()
