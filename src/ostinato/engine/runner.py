"""ModelRunner: persistent input buffers, step preparation, and graphs through GraphManager."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ostinato.batch import BatchDescriptor
from ostinato.config import GraphConfig
from ostinato.context import forward_context
from ostinato.dispatcher import Dispatcher
from ostinato.engine.attention import AttentionBackend, AttentionMetadata
from ostinato.engine.attention_op import StepAttention
from ostinato.engine.kv_cache import KVCache
from ostinato.engine.limits import EngineLimits
from ostinato.engine.model import DecoderModel
from ostinato.engine.scheduler import Step
from ostinato.manager import GraphManager
from ostinato.modes import GraphMode
from ostinato.piecewise import CompiledModel, PiecewiseBackend
from ostinato.platform import current_platform
from ostinato.pool import CaptureReport
from ostinato.support import ModeResolution, resolve_mode


class ModelRunner:
    """Runs one scheduled step of ``DecoderModel`` and returns the last-token logits.

    Guarantees: every device input of a step lives in a buffer allocated here once
    (input ids, positions, token-to-request map, slot mapping, block tables), so
    captured graphs replay on new data. Rows between the real and the padded token
    count are padding: position -1 (attends to nothing) and slot 0 of the null block
    (written, never read), so they never touch a real request's KV.
    """

    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        backend: AttentionBackend,
        limits: EngineLimits,
        graph_config: GraphConfig,
        device: torch.device,
        progress: bool = True,
        compiler: str | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend
        self.limits = limits
        self.device = device
        self.resolution: ModeResolution = resolve_mode(
            graph_config.mode,
            self.backend.graph_support,
            piecewise_available=compiler is not None,
            platform_has_graphs=current_platform().supports_graphs and device.type != "cpu",
        )
        self.dispatcher = Dispatcher(
            graph_config, self.resolution.mode, max_num_reqs=limits.max_num_seqs
        )
        t = limits.max_num_batched_tokens
        max_blocks = limits.blocks_per_seq
        self.input_ids = torch.zeros(t, dtype=torch.long, device=device)
        self.positions = torch.full((t,), -1, dtype=torch.long, device=device)
        self.token_req = torch.zeros(t, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(t, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(
            (limits.max_num_seqs, max_blocks), dtype=torch.int32, device=device
        )
        # Pinned host staging for the step inputs. Reusing it each step is safe because
        # every step ends by reading the sampled tokens back, which waits for the copies.
        pin = device.type == "cuda"
        self._staging = torch.zeros((4, t), dtype=torch.long, pin_memory=pin)
        self._tables_staging = torch.zeros_like(self.block_tables, device="cpu", pin_memory=pin)
        self.manager = GraphManager(
            self._step,
            self.dispatcher,
            prepare=self._dummy_metadata,
            num_warmups=graph_config.num_warmups,
            debug=graph_config.debug,
            progress=progress,
        )
        self.piecewise: PiecewiseBackend | None = None
        self.forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = model
        if compiler is not None:
            self.piecewise = PiecewiseBackend(
                compiler=compiler,
                debug=graph_config.debug,
                platform=self.manager.platform,
                pool=self.manager.pool,
            )
            self.forward = CompiledModel(model, self.piecewise)
        self.compile_seconds = 0.0

    def metadata(self, n: int, query_lens: list[int], seq_lens: list[int]) -> StepAttention:
        """The step's attention context over the first ``n`` rows of the persistent buffers."""
        meta = AttentionMetadata(
            self.positions[:n],
            self.token_req[:n],
            self.slot_mapping[:n],
            self.block_tables,
            query_lens,
            seq_lens,
        )
        return StepAttention(meta, self.cache, self.backend)

    def _dummy_metadata(self, d: BatchDescriptor) -> StepAttention:
        # Captures see all-padding rows: the kernels recorded depend only on the shape.
        n = d.num_tokens
        self.input_ids[:n].zero_()
        self.positions[:n].fill_(-1)
        self.token_req[:n].zero_()
        self.slot_mapping[:n].zero_()
        return self.metadata(n, [], [])

    def _step(self, d: BatchDescriptor) -> torch.Tensor:
        n = d.num_tokens
        return self.forward(self.input_ids[:n], self.positions[:n])

    @torch.inference_mode()
    def compile(self) -> float:
        """Compiles the model (piecewise backend) once, at the largest size; returns seconds."""
        if self.piecewise is None or self.piecewise.stats.compiles:
            return 0.0
        start = time.perf_counter()
        d = BatchDescriptor(self.limits.max_num_batched_tokens)
        with forward_context(GraphMode.NONE, d, self._dummy_metadata(d)):
            self._step(d)
        self.manager.platform.synchronize()
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds

    def capture(self) -> CaptureReport:
        """Compiles if needed, then captures every graph of the resolved mode."""
        self.compile()
        return self.manager.capture()

    def release(self) -> None:
        """Destroys every graph this runner captured (FULL and piecewise); it must not run
        a graph mode afterwards. Safe to call more than once."""
        self.manager.release()
        if self.piecewise is not None:
            self.piecewise.release()

    @torch.inference_mode()
    def execute(self, step: Step) -> torch.Tensor:
        """Runs ``step``; returns float32 logits, one row per scheduled request."""
        n = step.num_tokens
        plan = self.manager.plan(n, uniform_decode=step.uniform_decode)
        padded = plan.padded_tokens
        if padded > self.limits.max_num_batched_tokens:
            raise ValueError(f"step of {n} tokens exceeds max_num_batched_tokens")
        last, query_lens, seq_lens = self._write_inputs(step, padded)
        meta = self.metadata(padded, query_lens, seq_lens)
        hidden = self.manager.run(plan, n, attn_metadata=meta)
        return self.model.compute_logits(hidden[last])

    def _write_inputs(self, step: Step, padded: int) -> tuple[torch.Tensor, list[int], list[int]]:
        bs = self.limits.block_size
        ids, pos, req_of, slots, last = [], [], [], [], []
        query_lens, seq_lens = [], []
        for r, s in enumerate(step.scheduled):
            k = len(s.tokens)
            blocks = s.request.blocks
            ids += s.tokens
            pos += range(s.start, s.start + k)
            req_of += [r] * k
            slots += [blocks[p // bs] * bs + p % bs for p in range(s.start, s.start + k)]
            last.append(len(ids) - 1)
            query_lens.append(k)
            seq_lens.append(s.start + k)
            self._tables_staging[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        n = len(ids)
        staging = self._staging
        staging[0, :n] = torch.tensor(ids)
        staging[1, :n] = torch.tensor(pos)
        staging[2, :n] = torch.tensor(req_of)
        staging[3, :n] = torch.tensor(slots)
        staging[0, n:padded] = 0
        staging[1, n:padded] = -1
        staging[2:, n:padded] = 0
        self.input_ids[:padded].copy_(staging[0, :padded], non_blocking=True)
        self.positions[:padded].copy_(staging[1, :padded], non_blocking=True)
        self.token_req[:padded].copy_(staging[2, :padded], non_blocking=True)
        self.slot_mapping[:padded].copy_(staging[3, :padded], non_blocking=True)
        num_reqs = len(step.scheduled)
        self.block_tables[:num_reqs].copy_(self._tables_staging[:num_reqs], non_blocking=True)
        return torch.tensor(last, device=self.device), query_lens, seq_lens
