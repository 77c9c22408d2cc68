"""The self-draft proposer: the target's first N layers, with its final norm and LM head,
propose ``k`` tokens greedily, one forward pass per token over every drafting request.

It needs no cache of its own: layers below N have the same weights in draft and target,
so the K/V the target wrote for accepted positions is exactly the draft's, and the draft's
writes at speculative positions (slots the scheduler reserved) are overwritten when the
target verifies them.
"""

from __future__ import annotations

import torch

from ostinato.batch import BatchDescriptor
from ostinato.context import forward_context
from ostinato.engine.attention import AttentionBackend
from ostinato.engine.attention_op import StepAttention
from ostinato.engine.inputs import StepInputs
from ostinato.engine.kv_cache import KVCache
from ostinato.engine.limits import EngineLimits
from ostinato.engine.model import DecoderModel
from ostinato.engine.scheduler import Request, ScheduledBatch, ScheduledRequest
from ostinato.modes import GraphMode


class SelfDraftProposer:
    """Greedy drafts from ``model``'s first ``layers`` layers (eager)."""

    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        backend: AttentionBackend,
        limits: EngineLimits,
        device: torch.device,
        layers: int,
    ) -> None:
        if not 1 <= layers < model.config.num_layers:
            raise ValueError(
                f"speculative: self:{layers} must use fewer layers than the model's "
                f"{model.config.num_layers} (and at least 1)"
            )
        self.model, self.cache, self.backend, self.layers = model, cache, backend, layers
        self.inputs = StepInputs(limits, device)  # its own buffers: the target's stay put

    @torch.inference_mode()
    def __call__(self, requests: list[Request], n: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        current = [r.output[-1] for r in requests]
        for i in range(max(n, default=0)):
            active = [j for j, k in enumerate(n) if k > i]
            step = ScheduledBatch(
                [
                    ScheduledRequest(requests[j], [current[j]], requests[j].num_cached + i)
                    for j in active
                ]
            )
            m = len(active)
            layout = self.inputs.write(step, m)
            meta = StepAttention(
                self.inputs.metadata(m, layout.query_lens, layout.seq_lens),
                self.cache,
                self.backend,
            )
            with forward_context(GraphMode.NONE, BatchDescriptor(m), meta):
                hidden = self.model(
                    self.inputs.input_ids[:m], self.inputs.positions[:m], self.layers
                )
            tokens = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for j, token in zip(active, tokens, strict=True):
                drafts[j].append(token)
                current[j] = token
        return drafts
