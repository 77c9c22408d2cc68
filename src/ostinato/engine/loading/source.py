"""Where a model comes from: a preset name, a Hugging Face folder, a GGUF file, or a config.

``open_model`` turns what the user passed into a ``ModelSource`` without allocating the
model: its config, how to load its weights (None only when random weights were asked
for: a config, a shape preset, or ``random_weights=True``), its tokenizer and EOS tokens.
Anything it cannot use raises ``ModelConfigError`` or ``WeightsError`` naming the path.

A GGUF file goes through the model cache (``model_cache``) unless ``cache`` is None: the
first load converts it and writes an entry; later loads read the entry (safetensors,
``tokenizer.json``) and never parse the GGUF file.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ostinato.engine.loading.gguf_file import GGUFCheckpoint
from ostinato.engine.loading.gguf_tokenizer import (
    TokenizerBuiltHere,
    TokenizerChild,
    TokenizerChildError,
    tokenizer_build,
)
from ostinato.engine.loading.model_cache import CachedModel, ModelCache, SaveTokenizer
from ostinato.engine.loading.tokenizer_file import load_tokenizer
from ostinato.engine.loading.weights import assign_tensors, checkpoint_files, load_weights
from ostinato.engine.model.config import ModelConfig, ModelConfigError
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.model.presets import PRESETS, SHAPES, SMOLLM2, model_path

logger = logging.getLogger(__name__)

ModelSpec = str | Path | dict[str, Any] | ModelConfig | None


@dataclass
class ModelSource:
    """A model ready to be built: ``load`` is None for random weights; ``dtype`` is the
    checkpoint's own precision where it has one that bfloat16 would lose. ``pending``:
    the tokenizer still being built (``open_model(..., later=True)``): a conversion's
    (``gguf_tokenizer``: on a thread, or in a child process), with the model-cache entry
    written beside it, a cached model's read on a thread; ``finish`` waits for it."""

    name: str
    config: ModelConfig
    load: Callable[[DecoderModel], None] | None
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    pending: Future | None = None

    def finish(self) -> Any:
        """Waits for the pending tokenizer and cache entry (re-raising what failed there);
        returns the tokenizer."""
        if self.pending is not None:
            self.tokenizer, self.pending = self.pending.result(), None
        return self.tokenizer


def open_model(
    model: ModelSpec,
    random_weights: bool = False,
    cache: ModelCache | None = None,
    dtype: torch.dtype | None = None,
    later: bool = False,
) -> ModelSource:
    """Resolves ``model`` (see the module docstring). ``None`` is SmolLM2-135M-Instruct.
    ``dtype``: the dtype the engine will run, if the caller chose one (a converted
    source is cached in it; GGUF's default is float32). ``later``: a GGUF conversion
    returns once its weights are ready, its tokenizer and cache entry ``pending``, and a
    cached one with its tokenizer ``pending`` (``ModelSource.finish``); otherwise
    everything is done on return."""
    source = _open(model, random_weights, cache, dtype)
    if not later:
        source.finish()
    return source


def _open(
    model: ModelSpec, random_weights: bool, cache: ModelCache | None, dtype: torch.dtype | None
) -> ModelSource:
    if model is None:
        model = SMOLLM2
    if isinstance(model, ModelConfig):
        return ModelSource("a ModelConfig (random weights)", model, None)
    if isinstance(model, dict):
        return ModelSource("a config dict (random weights)", ModelConfig.from_hf(model), None)
    if not isinstance(model, (str, Path)):
        raise TypeError(
            f"model: expected a path, a preset name, a config dict or a ModelConfig, got "
            f"{type(model).__name__}"
        )
    if isinstance(model, str) and model in SHAPES and not Path(model).exists():
        return ModelSource(f"{model} (random weights)", ModelConfig.from_hf(SHAPES[model]), None)
    path = model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf(path, random_weights, cache, dtype)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _hf_folder(path, random_weights)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf(ggufs[0], random_weights, cache, dtype)
        if ggufs:
            raise ModelConfigError(
                f"model directory {path}: holds several GGUF files "
                f"({', '.join(g.name for g in ggufs)}); pass the one to load"
            )
        raise ModelConfigError(
            f"model directory {path}: no config.json and no .gguf file; point --model at a "
            "Hugging Face checkpoint folder or a GGUF file"
        )
    if path.exists():
        raise ModelConfigError(f"model {path}: not a folder or a .gguf file")
    raise ModelConfigError(
        f"model {str(model)!r}: no such file or folder, and not a preset ({', '.join(PRESETS)})"
    )


def _gguf(
    path: Path, random_weights: bool, cache: ModelCache | None, dtype: torch.dtype | None
) -> ModelSource:
    # Dequantized GGUF weights are float32 (llama.cpp computes in float32 too); rounding
    # them again to bfloat16 on top of 4-bit quantization flips near-tied tokens.
    run_dtype = dtype or torch.float32
    if cache is not None and not random_weights:
        hit = cache.lookup(path, run_dtype)
        if hit is not None:
            return _cached(str(path), hit)
    if random_weights or cache is None:
        ckpt = GGUFCheckpoint(path)
        load = None if random_weights else ckpt.load_into
        return ModelSource(
            str(path), ckpt.config, load, ckpt.tokenizer(), ckpt.eos_token_ids, torch.float32
        )
    ckpt = GGUFCheckpoint(path)
    # Before the weights: a child (where one builds it) starts its seconds of imports now.
    build = tokenizer_build(path, ckpt.reader.fields)
    try:
        tensors = {name: t.to(run_dtype) for name, t in ckpt.tensors()}
    except BaseException:
        build.close()
        raise

    def tokenizer_and_entry() -> Any:
        made: list[Any] = []

        def save(folder: Path) -> None:  # after the weights
            tokenizer, copy = _tokenizer_of(ckpt, build)
            made.append(tokenizer)
            if copy is not None:
                copy(folder)

        try:
            folder = cache.store(path, run_dtype, ckpt.config, ckpt.eos_token_ids, tensors, save)
            if not made:  # the cache failed before the tokenizer's turn
                made.append(_tokenizer_of(ckpt, build)[0])
        finally:
            build.close()
        if folder is not None:
            logger.info("ostinato: %s converted once into the model cache at %s", path, folder)
        return made[0]

    return ModelSource(
        str(path),
        ckpt.config,
        lambda model: assign_tensors(model, tensors.items(), str(path)),
        eos_token_ids=ckpt.eos_token_ids,
        dtype=torch.float32,
        # Neither is needed before the first step: they go beside the rest of the start
        # (the weights, the KV cache, the kernel plans).
        pending=_on_thread(tokenizer_and_entry),
    )


def _tokenizer_of(
    ckpt: GGUFCheckpoint, build: TokenizerBuiltHere | TokenizerChild
) -> tuple[Any, SaveTokenizer | None]:
    """The tokenizer ``build`` made, read back from its files, and how to copy them into
    an entry; where it failed, named in a warning, the one transformers builds here."""
    try:
        built = build.wait()
    except (TokenizerChildError, ValueError) as exc:
        logger.warning("ostinato: %s; building the tokenizer with transformers instead", exc)
        tokenizer = ckpt.tokenizer()
        if tokenizer is None:
            return None, None
        return tokenizer, lambda folder: tokenizer.save_pretrained(str(folder))
    if built is None:  # transformers is not installed
        return None, None
    return _folder_tokenizer(built), lambda folder: shutil.copytree(built, folder)


def _on_thread(work: Callable[[], Any]) -> Future:
    """``work()`` on a thread of its own; the interpreter waits for it at exit, and
    ``ModelSource.finish`` gets its result or its error."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="ostinato-tokenizer")
    future = executor.submit(work)
    executor.shutdown(wait=False)  # the thread ends with ``work``
    return future


def _cached(name: str, entry: CachedModel) -> ModelSource:
    def load(model: DecoderModel) -> None:
        load_weights(model, entry.folder)

    folder = entry.tokenizer_dir
    # Read beside the rest of the start, as a conversion's tokenizer is (0.25 s of the
    # development CPU's open): the weights, the KV cache and the captures need none.
    pending = _on_thread(lambda: _folder_tokenizer(folder)) if folder else None
    return ModelSource(
        name, entry.config, load, None, entry.eos_token_ids, torch.float32, pending=pending
    )


def _folder_tokenizer(folder: Path) -> Any:
    # Without importing transformers where the files allow it (seconds: tokenizer_file).
    return load_tokenizer(folder) or _hf_tokenizer(folder)


def _hf_folder(path: Path, random_weights: bool) -> ModelSource:
    config = ModelConfig.from_dir(path)
    load = None
    if not random_weights:
        checkpoint_files(path)  # fail now, before anything is allocated

        def load(model: DecoderModel) -> None:
            load_weights(model, path)

    return ModelSource(str(path), config, load, _hf_tokenizer(path), _hf_eos(path))


def _hf_tokenizer(path: Path) -> Any:
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        logger.warning("ostinato: %s has a tokenizer but transformers is not installed", path)
        return None
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _hf_eos(path: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if not f.is_file():
            continue
        try:
            eos = json.loads(f.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelConfigError(f"{f}: not valid JSON ({exc})") from None
        if eos is None:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        if not all(isinstance(i, int) for i in ids):
            raise ModelConfigError(f"{f}: eos_token_id must be an int or a list of ints")
        return tuple(ids)
    return ()
