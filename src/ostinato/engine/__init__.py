"""The reference LLM engine: a Llama-family model over a paged KV cache, continuous
batching, and ostinato graphs. It uses only ostinato's public API."""

from ostinato.engine.api.llm import LLM, RequestOutput
from ostinato.engine.core.scheduler import FinishReason
from ostinato.engine.kernels.options import KernelOptions
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.sample.sampler import SamplingParams

__all__ = ["LLM", "FinishReason", "KernelOptions", "ModelConfig", "RequestOutput", "SamplingParams"]
