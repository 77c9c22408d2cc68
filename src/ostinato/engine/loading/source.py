"""Where a model comes from: a preset name, a Hugging Face folder, a GGUF file, or a config.

``open_model`` turns what the user passed into a ``ModelSource`` without allocating the
model: its config, how to load its weights (None only when random weights were asked
for: a config, a shape preset, or ``random_weights=True``), its tokenizer and EOS tokens.
Anything it cannot use raises ``ModelConfigError`` or ``WeightsError`` naming the path.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ostinato.engine.loading.gguf_file import GGUFCheckpoint
from ostinato.engine.loading.weights import checkpoint_files, load_weights
from ostinato.engine.model.config import ModelConfig, ModelConfigError
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.model.presets import PRESETS, SHAPES, SMOLLM2, smollm2_path

logger = logging.getLogger(__name__)

ModelSpec = str | Path | dict[str, Any] | ModelConfig | None


@dataclass
class ModelSource:
    """A model ready to be built: ``load`` is None for random weights; ``dtype`` is the
    checkpoint's own precision where it has one that bfloat16 would lose."""

    name: str
    config: ModelConfig
    load: Callable[[DecoderModel], None] | None
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype | None = None


def open_model(model: ModelSpec, random_weights: bool = False) -> ModelSource:
    """Resolves ``model`` (see the module docstring). ``None`` is SmolLM2-135M-Instruct."""
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
    path = smollm2_path() if model == SMOLLM2 and not Path(model).exists() else Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf(path, random_weights)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _hf_folder(path, random_weights)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf(ggufs[0], random_weights)
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


def _gguf(path: Path, random_weights: bool) -> ModelSource:
    ckpt = GGUFCheckpoint(path)
    load = None if random_weights else ckpt.load_into
    # Dequantized GGUF weights are float32 (llama.cpp computes in float32 too); rounding
    # them again to bfloat16 on top of 4-bit quantization flips near-tied tokens.
    return ModelSource(
        str(path), ckpt.config, load, ckpt.tokenizer(), ckpt.eos_token_ids, torch.float32
    )


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
