"""The self-draft proposer: the target's first N layers, with its final norm and LM head,
propose ``k`` tokens greedily, and the whole k-step loop is one FULL graph per batch size.

It needs no cache of its own: layers below N have the same weights in draft and target,
so the K/V the target wrote for accepted positions is exactly the draft's, and the draft's
writes at speculative positions (slots the scheduler reserved) are overwritten when the
target verifies them. Each loop step feeds its argmax back as the next input and advances
positions and slots on the device, so one replay turns the requests' last tokens into their
drafts; rows past a request's room (or padding) write only to the null block.
"""

from __future__ import annotations

import time

import torch

from ostinato.batch import BatchDescriptor
from ostinato.capture_report import CaptureReport
from ostinato.config import GraphConfig
from ostinato.context import forward_context, get_forward_context
from ostinato.engine.core.kv_cache import KVCache
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.scheduler import Request, ScheduledBatch, ScheduledRequest
from ostinato.engine.core.transfer import to_device
from ostinato.engine.model.attention import AttentionBackend
from ostinato.engine.model.attention_op import StepAttention
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.sample.greedy import greedy_tokens
from ostinato.engine.worker.inputs import PADDING, StepInputs
from ostinato.modes import GraphMode
from ostinato.platform import platform_for_device
from ostinato.runtime import GraphRuntime, build_graph_runtime


class SelfDraftProposer:
    """Greedy ``k``-token drafts from ``model``'s first ``layers`` layers, replayed from
    one graph per batch size where the device has graphs (captured by ``capture``, into
    ``pool`` when given: the target's shared pool), eagerly elsewhere: same code."""

    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        backend: AttentionBackend,
        limits: EngineLimits,
        device: torch.device,
        layers: int,
        k: int,
        pool: object = None,
        progress: bool = False,
        graphs: bool = True,
    ) -> None:
        if not 1 <= layers < model.config.num_layers:
            raise ValueError(
                f"speculative: self:{layers} must use fewer layers than the model's "
                f"{model.config.num_layers} (and at least 1)"
            )
        self.model, self.cache, self.backend = model, cache, backend
        self.layers, self.k, self.block_size = layers, k, limits.block_size
        self.inputs = StepInputs(limits, device)  # its own buffers: the target's stay put
        # [max_num_seqs] how many draft tokens each row may write K/V for
        self.room = torch.zeros(limits.max_num_seqs, dtype=torch.long, device=device)
        self.host_seq_lens: list[int] = []
        self.calls, self.seconds = 0, 0.0  # drafting calls and their wall time (ends synced)
        platform = platform_for_device(device)
        with_graphs = graphs and platform.supports_graphs
        mode = GraphMode.FULL_DECODE_ONLY if with_graphs else GraphMode.NONE
        self.graphs: GraphRuntime = build_graph_runtime(
            self._loop,
            GraphConfig(
                mode=mode,
                max_capture_size=limits.max_num_seqs,
                max_num_tokens=limits.max_num_seqs,
            ),
            attention=backend.graph_support,
            prepare=self._dummy,
            max_num_reqs=limits.max_num_seqs,
            platform=platform,
            pool=pool,
            progress=progress,
        )

    def capture(self) -> CaptureReport:
        """Captures the draft loop at every batch size (nothing on a device without graphs)."""
        return self.graphs.manager.capture()

    def release(self) -> None:
        """Destroys the draft graphs."""
        self.graphs.manager.release()

    @torch.inference_mode()
    def __call__(self, requests: list[Request], n: list[int]) -> list[list[int]]:
        start = time.perf_counter()
        drafts = self._draft(requests, n)
        self.calls += 1
        self.seconds += time.perf_counter() - start
        return drafts

    def _draft(self, requests: list[Request], n: list[int]) -> list[list[int]]:
        m = len(requests)
        step = ScheduledBatch([ScheduledRequest(r, [r.output[-1]], r.num_cached) for r in requests])
        layout = self.inputs.write(step, m)
        self.host_seq_lens = layout.seq_lens  # for the torch attention backend's host loop
        self.room[:m].copy_(to_device(n, torch.long, self.room.device))
        dispatch = self.graphs.dispatch(m, uniform_decode=True)
        meta = self._metadata(dispatch.padded_tokens, layout.seq_lens)
        if dispatch.padded_tokens > m:
            self._pad_rows(m, dispatch.padded_tokens)
        drafts = self.graphs.manager.run(dispatch, m, attn_metadata=meta).tolist()
        return [row[:k] for row, k in zip(drafts, n, strict=True)]

    def _metadata(self, rows: int, seq_lens: list[int], step: int = 0) -> StepAttention:
        lens = [s + step for s in seq_lens]
        return StepAttention(
            self.inputs.metadata(rows, [1] * len(lens), lens, 1), self.cache, self.backend
        )

    def _pad_rows(self, start: int, stop: int) -> None:
        self.inputs.write_padding(stop, start)
        self.room[start:stop].zero_()

    def _dummy(self, d: BatchDescriptor) -> StepAttention:
        self._pad_rows(0, d.num_tokens)
        self.host_seq_lens = []
        return self._metadata(d.num_tokens, [])

    def _loop(self, d: BatchDescriptor) -> torch.Tensor:
        """``k`` greedy steps over the first ``d.num_tokens`` rows; ``[rows, k]`` tokens."""
        rows = d.num_tokens
        ids, pos = self.inputs.input_ids[:rows], self.inputs.positions[:rows]
        req, slots = self.inputs.token_req[:rows], self.inputs.slot_mapping[:rows]
        room, bs = self.room[:rows], self.block_size
        seq_lens = self.host_seq_lens
        mode = get_forward_context().runtime_mode  # FULL while captured, else NONE
        out = []
        for i in range(self.k):
            if i:
                # Next input: the last draft token, one position on, at its slot (rows past
                # their room, and padding rows, write to the null block and are ignored).
                ids.copy_(out[-1])
                real = pos >= 0
                pos.copy_(torch.where(real, pos + 1, pos))
                p = pos.clamp(min=0)
                slot = self.inputs.block_tables[req.long(), p // bs].long() * bs + p % bs
                slots.copy_(torch.where(real & (room > i), slot, PADDING.slot))
            with forward_context(mode, d, self._metadata(rows, seq_lens, i)):
                hidden = self.model(ids, pos, self.layers)
            out.append(greedy_tokens(self.model.compute_logits(hidden)))
        return torch.stack(out, dim=1)
