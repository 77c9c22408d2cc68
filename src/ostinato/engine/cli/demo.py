"""A tiny token-wise model and runner that show the whole flow; used by ``ostinato demo``.

The model is a stack of pre-norm MLP blocks (no attention, so every token is independent
and a FULL graph serves any batch); the runner keeps its input in one persistent buffer.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ostinato.batch import BatchDescriptor
from ostinato.config import GraphConfig
from ostinato.modes import GraphMode
from ostinato.platform import current_platform
from ostinato.runtime import build_graph_runtime


class MlpBlock(nn.Module):
    """RMS-normed SwiGLU MLP with a residual connection."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class TinyModel(nn.Module):
    """Embedding, ``layers`` MLP blocks, final norm; returns hidden states per token."""

    def __init__(
        self, vocab: int = 1000, hidden: int = 256, intermediate: int = 512, layers: int = 4
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(MlpBlock(hidden, intermediate) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-6)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class TinyRunner:
    """A model runner: a persistent input buffer and graphs from ``build_graph_runtime``.

    ``forward(ids)`` copies ids into the buffer, pads with token 0 up to the dispatched
    size, and returns hidden states for exactly ``len(ids)`` tokens.
    """

    def __init__(
        self,
        model: nn.Module,
        config: GraphConfig,
        device: torch.device,
        progress: bool = True,
        pool: Any = None,
    ) -> None:
        self.model = model
        self.input_ids = torch.zeros(max(config.largest_size, 1), dtype=torch.long, device=device)
        # ``pool``: a graph memory pool of the caller's; the process's shared one if None.
        self.graphs = build_graph_runtime(self._step, config, progress=progress, pool=pool)

    def _step(self, d: BatchDescriptor) -> torch.Tensor:
        return self.model(self.input_ids[: d.num_tokens])

    def capture(self) -> None:
        """Captures every size of the ladder (nothing on a platform without graphs)."""
        self.graphs.manager.capture()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        dispatch = self.graphs.dispatch(n)
        if dispatch.padded_tokens > self.input_ids.shape[0]:
            return self.model(ids)  # larger than any graph: eager on the caller's tensor
        self.input_ids[:n].copy_(ids)
        self.input_ids[n : dispatch.padded_tokens].zero_()
        return self.graphs.manager.run(dispatch, n)


@dataclass
class DemoResult:
    """What the demo did and the largest difference it saw between graph and eager."""

    platform: str
    mode: GraphMode
    reasons: tuple[str, ...]
    graphs: int
    capture_summary: str
    max_abs_error: float
    steps: int


def run_demo(num_steps: int = 20, seed: int = 0, progress: bool = True) -> DemoResult:
    """Builds the tiny model, captures its ladder, runs random batch sizes, checks vs eager."""
    platform = current_platform()
    device = torch.device(platform.device_type)
    dtype = torch.bfloat16 if platform.supports_graphs else torch.float32
    torch.manual_seed(seed)
    model = TinyModel().to(device=device, dtype=dtype).eval()
    config = GraphConfig(mode=GraphMode.FULL, max_capture_size=128)
    runner = TinyRunner(model, config, device, progress=progress)
    runner.capture()
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _ in range(num_steps):
        n = int(torch.randint(1, 160, (1,), generator=gen))
        ids = torch.randint(0, 1000, (n,), generator=gen).to(device)
        with torch.inference_mode():
            got = runner.forward(ids)
            want = model(ids)
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    return DemoResult(
        platform.name,
        runner.graphs.mode,
        runner.graphs.resolution.reasons,
        runner.graphs.manager.num_graphs,
        runner.graphs.manager.report.summary(),
        worst,
        num_steps,
    )


@dataclass
class AnswerResult:
    """The real model's answer to one chat question, and how fast it came."""

    question: str
    answer: str
    mode: GraphMode
    device: str
    tokens: int
    seconds: float
    startup_seconds: float


def answer_demo(
    question: str = "What is the capital of France?", max_tokens: int = 48
) -> AnswerResult:
    """Asks SmolLM2-135M-Instruct (the engine's default model) ``question``, greedily."""
    from ostinato.engine import LLM, SamplingParams

    llm = LLM(max_model_len=512, max_num_seqs=4, max_capture_size=32, progress=False)
    start = time.perf_counter()
    (out,) = llm.chat(
        [{"role": "user", "content": question}], SamplingParams(max_tokens=max_tokens)
    )
    seconds = time.perf_counter() - start
    return AnswerResult(
        question,
        out.text or "",
        llm.mode,
        str(llm.device),
        len(out.token_ids),
        seconds,
        llm.startup_seconds,
    )


def main() -> int:
    """Runs the graph demo, then the real model's answer, and prints both."""
    start = time.perf_counter()
    r = run_demo()
    print(f"platform: {r.platform}; graph mode: {r.mode.name}")
    for why in r.reasons:
        print(f"  downgraded: {why}")
    print(f"captured {r.graphs} FULL graphs: {r.capture_summary}")
    print(f"ran {r.steps} steps of random batch size 1..159 (sizes above 128 run eagerly)")
    print(f"max |graph - eager| = {r.max_abs_error:.3g}; took {time.perf_counter() - start:.1f} s")
    try:
        a = answer_demo()
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"\nSmolLM2-135M-Instruct on {a.device}, graph mode {a.mode.name} "
        f"(start-up {a.startup_seconds:.1f} s)"
    )
    print(f"Q: {a.question}\nA: {a.answer}")
    print(f"{a.tokens} tokens in {a.seconds:.2f} s: {a.tokens / a.seconds:.1f} tokens/s")
    return 0
