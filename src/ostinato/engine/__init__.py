"""The reference LLM engine: a Llama-family model over a paged KV cache, continuous
batching, and ostinato graphs. It uses only ostinato's public API."""

from ostinato.engine.config import ModelConfig
from ostinato.engine.kernel_options import KernelOptions
from ostinato.engine.llm import LLM, RequestOutput
from ostinato.engine.sampler import SamplingParams
from ostinato.engine.scheduler import FinishReason

__all__ = ["LLM", "FinishReason", "KernelOptions", "ModelConfig", "RequestOutput", "SamplingParams"]
