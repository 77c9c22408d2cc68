"""``LLM``: the engine's user API — token ids (or text, with a tokenizer) in, tokens out."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ostinato.config import GraphConfig
from ostinato.engine.attention import AttentionBackend, default_backend
from ostinato.engine.config import TINY_LLAMA, ModelConfig
from ostinato.engine.kv_cache import BlockPool, KVCache
from ostinato.engine.model import DecoderModel
from ostinato.engine.runner import ModelRunner, RunnerLimits, num_blocks_for
from ostinato.engine.sampler import SamplingParams, sample
from ostinato.engine.scheduler import FinishReason, Request, Scheduler
from ostinato.engine.weights import load_weights
from ostinato.modes import GraphMode
from ostinato.pool import CaptureReport

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """One prompt's result, in the order the prompts were given."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    text: str | None = None


class LLM:
    """A compact inference engine over ostinato's graphs.

    ``model``: a directory with ``config.json`` (and ``*.safetensors``; without them
    weights are random), a HF config dict, a ``ModelConfig``, or None for the embedded
    tiny Llama. ``mode``: a ``GraphMode`` or name; ``"auto"`` is FULL_AND_PIECEWISE on CUDA
    and NONE on CPU (downgrades are logged with their reason). ``compiler``: how pieces are
    compiled for piecewise graphs: ``"inductor"``, ``"eager"``, None (no compilation, so
    piecewise modes downgrade), or ``"auto"`` (Inductor when the mode needs pieces, on
    CUDA). The model is compiled and every graph captured at construction.
    """

    def __init__(
        self,
        model: str | Path | dict[str, Any] | ModelConfig | None = None,
        *,
        mode: GraphMode | str = "auto",
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        block_size: int = 16,
        max_num_seqs: int = 32,
        max_model_len: int = 1024,
        max_num_batched_tokens: int | None = None,
        num_blocks: int | None = None,
        capture_sizes: tuple[int, ...] | None = None,
        max_capture_size: int = 512,
        backend: AttentionBackend | None = None,
        compiler: str | None = "auto",
        seed: int = 0,
        progress: bool = True,
    ) -> None:
        start = time.perf_counter()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        model_dir = Path(model) if isinstance(model, (str, Path)) else None
        self.config = _model_config(model)
        self.tokenizer = _tokenizer(model_dir)
        max_num_batched_tokens = max_num_batched_tokens or max(max_model_len, 2048)
        limits = RunnerLimits(max_num_seqs, max_num_batched_tokens, max_model_len, block_size)
        torch.manual_seed(seed)
        self.model = DecoderModel(self.config)
        if model_dir is not None and any(model_dir.glob("*.safetensors")):
            load_weights(self.model, model_dir)
        else:
            logger.warning("ostinato: no weights given; using random weights (seed %d)", seed)
        self.model = self.model.to(self.device, dtype).eval()
        num_blocks = num_blocks or num_blocks_for(limits)
        c = self.config
        self.cache = KVCache(
            c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype, self.device
        )
        if mode == "auto":
            on_gpu = self.device.type == "cuda"
            mode = GraphMode.FULL_AND_PIECEWISE if on_gpu else GraphMode.NONE
        graph_config = GraphConfig(
            mode=mode,
            capture_sizes=capture_sizes,
            max_capture_size=max_capture_size,
            max_num_tokens=max_num_batched_tokens,
        )
        self.runner = ModelRunner(
            self.model,
            self.cache,
            backend or default_backend(self.device),
            limits,
            graph_config,
            self.device,
            progress=progress,
            compiler=_compiler(compiler, graph_config.mode, self.device),
        )
        eos = _eos(model_dir)
        self.scheduler = Scheduler(
            BlockPool(num_blocks),
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            eos,
        )
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.capture_report: CaptureReport = self.runner.capture()
        self.startup_seconds = time.perf_counter() - start

    @property
    def mode(self) -> GraphMode:
        """The graph mode in use after downgrades."""
        return self.runner.resolution.mode

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns outputs in prompt order.

        Raises ``ValueError`` before running anything if any prompt is invalid (empty,
        too long, or text without a tokenizer): no prompt is half-accepted.
        """
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} given for {len(prompts)} prompts")
        token_prompts = [self._encode(p) for p in prompts]
        for i, tokens in enumerate(token_prompts):
            self._check_prompt(i, tokens)
        requests = [self.scheduler.add(t, p) for t, p in zip(token_prompts, plist, strict=True)]
        while self.scheduler.has_work:
            self.step()
        return [self._output(r) for r in requests]

    def step(self) -> list[Request]:
        """Runs one scheduled step; returns the requests that finished in it."""
        step = self.scheduler.schedule()
        if not step.scheduled:
            raise RuntimeError("scheduler produced an empty step with work pending")
        logits = self.runner.execute(step)
        reqs = [s.request for s in step.scheduled]
        temps = torch.tensor([r.params.temperature for r in reqs], device=self.device)
        top_ps = torch.tensor([r.params.top_p for r in reqs], device=self.device)
        tokens = sample(logits, temps, top_ps, self.generator).tolist()
        return self.scheduler.update(step, tokens)

    def _encode(self, prompt: list[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompt: text given but the model has no tokenizer; pass token ids"
                )
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def _check_prompt(self, i: int, tokens: list[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i}: token ids {bad[:5]} outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )
        try:
            self.scheduler.check(tokens)
        except ValueError as exc:
            raise ValueError(str(exc).replace("prompt:", f"prompt {i}:", 1)) from None

    def _output(self, r: Request) -> RequestOutput:
        assert r.finish_reason is not None
        text = self.tokenizer.decode(r.output) if self.tokenizer is not None else None
        return RequestOutput(r.prompt, r.output, r.finish_reason, text)


def _compiler(choice: str | None, mode: GraphMode, device: torch.device) -> str | None:
    if choice != "auto":
        if choice not in (None, "inductor", "eager"):
            raise ValueError(f"compiler: 'auto', 'inductor', 'eager' or None, got {choice!r}")
        return choice
    return "inductor" if mode.has_piecewise_graphs() and device.type == "cuda" else None


def _model_config(model: str | Path | dict[str, Any] | ModelConfig | None) -> ModelConfig:
    if model is None:
        return ModelConfig.from_hf(TINY_LLAMA)
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, dict):
        return ModelConfig.from_hf(model)
    return ModelConfig.from_dir(model)


def _tokenizer(model_dir: Path | None) -> Any:
    if model_dir is None or not (model_dir / "tokenizer_config.json").is_file():
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        logger.warning("ostinato: %s has a tokenizer but transformers is not installed", model_dir)
        return None
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _eos(model_dir: Path | None) -> int | None:
    for name in ("generation_config.json", "config.json"):
        if model_dir is not None and (model_dir / name).is_file():
            eos = json.loads((model_dir / name).read_text()).get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            if eos is not None:
                return int(eos)
    return None
