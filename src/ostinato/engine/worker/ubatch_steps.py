"""A runner's micro-batched steps (``ostinato.ubatch``): which FULL sizes are captured as
two overlapped micro-batches (measured at capture, or by the policy's thresholds alone),
eager steps split in two, and the two threads that take turns at every collective.

Guarantees: a FULL size is captured split or plain, never both; every rank of every
replica splits the same sizes (the slowest rank's times decide); the threads (and on
CUDA the communication stream) are made at the first split run, an eager warm-up before
any capture, so nothing of theirs is initialised while a graph is being captured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ostinato.batch import BatchDescriptor
from ostinato.context import forward_context
from ostinato.engine.core.kv_cache import KVCache
from ostinato.engine.core.scheduler import ScheduledBatch
from ostinato.engine.model.attention import AttentionBackend
from ostinato.engine.model.attention_op import StepAttention
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.worker.inputs import StepInputs
from ostinato.engine.worker.ubatch_tuning import UbatchTiming, chosen, measure
from ostinato.guard import capture_phase
from ostinato.manager import GraphManager
from ostinato.modes import GraphMode
from ostinato.runtime import GraphRuntime
from ostinato.ubatch.handoff import CudaStreamOps, NoStreams, UbatchThreads
from ostinato.ubatch.policy import MicroBatching
from ostinato.ubatch.slicing import can_split, split_step

StepAs = Callable[[BatchDescriptor, bool], Any]  # a step of d, plain or split


def ubatch_candidates(
    policy: MicroBatching | None, model: DecoderModel, graphs: GraphRuntime
) -> tuple[BatchDescriptor, ...]:
    """The FULL sizes the policy's thresholds select: even row counts, under tensor
    parallelism, in FULL or FULL_DECODE_ONLY mode."""
    full_modes = (GraphMode.FULL, GraphMode.FULL_DECODE_ONLY)
    if policy is None or model.tp.group is None or graphs.mode not in full_modes:
        return ()
    return tuple(
        d
        for d in graphs.dispatcher.keys(GraphMode.FULL)
        if d.num_tokens % 2 == 0 and policy.applies(d.num_tokens, d.uniform_decode)
    )


class UbatchSteps:
    """The micro-batching of one runner (see the module docstring). ``graphs``: the FULL
    sizes captured split; ``steps`` / ``replays``: steps run split (eagerly or replayed),
    and of those the replays of split graphs; ``timings``: what capture measured."""

    def __init__(
        self,
        policy: MicroBatching | None,
        model: DecoderModel,
        inputs: StepInputs,
        cache: KVCache,
        backend: AttentionBackend,
        graphs: GraphRuntime,
    ) -> None:
        self.policy = policy
        self.model, self.inputs, self.cache, self.backend = model, inputs, cache, backend
        self.manager: GraphManager = graphs.manager
        self.device = inputs.input_ids.device
        self.steps = 0
        self.replays = 0
        self.candidates = ubatch_candidates(policy, model, graphs)
        self.timings: list[UbatchTiming] = []
        measured = policy is None or policy.measure
        self.graphs: frozenset[BatchDescriptor] = (
            frozenset() if measured else frozenset(self.candidates)
        )
        self._threads: UbatchThreads | None = None
        self._comm_stream: torch.cuda.Stream | None = None

    def choose(self, step_as: StepAs, dummy_metadata: Callable[[BatchDescriptor], Any]) -> None:
        """With a measuring policy, times each candidate plain and split (one throwaway
        graph each) and keeps split the sizes faster by the policy's margin, agreed over
        every rank, data-parallel replicas included."""
        policy = self.policy
        if policy is None or not policy.measure or not self.candidates:
            return
        everyone = dist.group.WORLD if dist.is_initialized() else self.model.tp.group

        def time_ms(d: BatchDescriptor, ubatched: bool) -> float:
            return self.replay_ms(d, ubatched, step_as, dummy_metadata(d))

        with capture_phase():  # one collection for all the timed captures
            self.timings = measure(self.candidates, time_ms, everyone)
        self.graphs = chosen(self.timings, policy.min_speedup)

    @torch.inference_mode()
    def replay_ms(self, d: BatchDescriptor, ubatched: bool, step_as: StepAs, meta: Any) -> float:
        """Mean ms of a replay of ``d``'s step captured plainly or split (a throwaway graph
        in the shared pool, on padding rows); call it inside ``capture_phase()``."""
        assert self.policy is not None
        platform, repeats = self.manager.platform, self.policy.measure_repeats
        with forward_context(GraphMode.NONE, d, meta):
            step_as(d, ubatched)  # warm-up; starts the micro-batch threads uncaptured
        graph = platform.new_graph()
        with forward_context(GraphMode.FULL, d, meta), platform.capture(graph, self.manager.pool):
            step_as(d, ubatched)
        try:
            graph.replay()
            platform.synchronize()
            start = time.perf_counter()
            for _ in range(repeats):
                graph.replay()
            platform.synchronize()
            return (time.perf_counter() - start) * 1e3 / repeats
        finally:
            graph.reset()

    def applies(self, mode: GraphMode, padded: int, step: ScheduledBatch) -> bool:
        """Whether ``step``, dispatched to ``mode`` at ``padded`` rows, runs split: a FULL
        graph if it was captured so; eagerly, if the policy applies and both halves hold
        real tokens."""
        if self.policy is None or self.model.tp.group is None:
            return False  # only where there are collectives to overlap
        if mode is GraphMode.FULL:
            return BatchDescriptor(padded, None, step.uniform_decode) in self.graphs
        if mode is not GraphMode.NONE:
            return False  # compiled pieces trace the all-reduce: no hand-off inside them
        return self.policy.applies(padded, step.uniform_decode) and can_split(
            step.num_tokens, padded
        )

    def run_eager(self, padded: int, query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
        """The step's hidden states, computed eagerly as two micro-batches."""
        slices = split_step(query_lens, padded)
        ids, pos = self.inputs.input_ids, self.inputs.positions

        def run(i: int) -> torch.Tensor:
            s = slices[i]
            meta = self._attention(self.inputs.ubatch_metadata(s, query_lens, seq_lens))
            with torch.inference_mode():
                with forward_context(GraphMode.NONE, BatchDescriptor(s.num_tokens), meta):
                    return self.model(ids[s.tokens], pos[s.tokens])

        outs = self._in_threads(run)
        self.steps += 1
        return torch.cat(outs)

    def run_static(self, n: int) -> torch.Tensor:
        """Hidden states of the first ``n`` rows as two micro-batches of ``n / 2`` rows
        whose attention reads only persistent buffers (each row finds its request through
        ``token_req`` in the whole block table), so the run can be captured in one graph
        and replayed for any step of ``n`` padded rows."""
        half = n // 2
        ids, pos = self.inputs.input_ids, self.inputs.positions

        def run(i: int) -> torch.Tensor:
            rows = slice(i * half, (i + 1) * half)
            meta = self._attention(self.inputs.rows_metadata(rows))
            with torch.inference_mode():
                with forward_context(GraphMode.NONE, BatchDescriptor(half), meta):
                    return self.model(ids[rows], pos[rows])

        return torch.cat(self._in_threads(run))

    def _attention(self, meta: Any) -> StepAttention:
        return StepAttention(meta, self.cache, self.backend)

    def _in_threads(self, run: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
        if self._threads is None:
            if self.device.type == "cuda":
                self._comm_stream = torch.cuda.Stream(self.device)
                device = self.device

                def prepare() -> None:
                    torch.cuda.set_device(device)
                    torch.cuda.current_blas_handle()

                self._threads = UbatchThreads(2, CudaStreamOps(), prepare)
            else:
                self._threads = UbatchThreads(2, NoStreams())
        if self.device.type == "cuda":
            compute, comm = torch.cuda.current_stream(), self._comm_stream
        else:
            compute = comm = None
        return self._threads.run(run, compute, comm)

    def close(self) -> None:
        """Ends the micro-batch threads (safe to call again)."""
        if self._threads is not None:
            self._threads.close()
            self._threads = None
