"""The reference LLM engine: a Llama-family model over a paged KV cache, continuous
batching, and ostinato graphs. It uses only ostinato's public API.

The names below are loaded on first use, so importing one sub-package (``core``,
``model``, ...) does not import the whole engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "LLM": "ostinato.engine.api.llm",
    "RequestOutput": "ostinato.engine.api.outputs",
    "CacheArgs": "ostinato.engine.api.engine_args",
    "GraphArgs": "ostinato.engine.api.engine_args",
    "ParallelArgs": "ostinato.engine.api.engine_args",
    "EngineArgs": "ostinato.engine.api.engine_args",
    "Engine": "ostinato.engine.api.engine",
    "EngineLoop": "ostinato.engine.serve.loop",
    "EngineProcess": "ostinato.engine.serve.engine_process",
    "KernelOptions": "ostinato.engine.kernels.options",
    "ModelConfig": "ostinato.engine.model.config",
    "SamplingParams": "ostinato.engine.core.params",
    "FinishReason": "ostinato.engine.core.scheduler",
    "SpeculativeConfig": "ostinato.engine.spec.speculative",
    "TokenLogprob": "ostinato.engine.core.logprob",
}

__all__ = [
    "LLM",
    "CacheArgs",
    "Engine",
    "EngineArgs",
    "EngineLoop",
    "EngineProcess",
    "FinishReason",
    "GraphArgs",
    "KernelOptions",
    "ModelConfig",
    "ParallelArgs",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "TokenLogprob",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ loads them
    from ostinato.engine.api.engine import Engine
    from ostinato.engine.api.engine_args import CacheArgs, EngineArgs, GraphArgs, ParallelArgs
    from ostinato.engine.api.llm import LLM
    from ostinato.engine.api.outputs import RequestOutput
    from ostinato.engine.core.logprob import TokenLogprob
    from ostinato.engine.core.params import SamplingParams
    from ostinato.engine.core.scheduler import FinishReason
    from ostinato.engine.kernels.options import KernelOptions
    from ostinato.engine.model.config import ModelConfig
    from ostinato.engine.serve.engine_process import EngineProcess
    from ostinato.engine.serve.loop import EngineLoop
    from ostinato.engine.spec.speculative import SpeculativeConfig


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'ostinato.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
