"""A reference for the self-draft: drafting step by step, eagerly (shared by the CPU and
GPU tests of the device-side draft loop)."""

import torch

from ostinato.batch import BatchDescriptor
from ostinato.context import forward_context
from ostinato.engine.core.scheduler import ScheduledBatch, ScheduledRequest
from ostinato.engine.model.attention_op import StepAttention
from ostinato.engine.worker.inputs import StepInputs
from ostinato.modes import GraphMode


class StepByStepDraft:
    """The self-draft computed the plain way: one eager forward pass per draft token over
    only the rows still drafting, each fed the previous argmax (a reference for the
    device-side loop that a graph can hold)."""

    def __init__(self, llm, layers):
        self.llm, self.layers = llm, layers
        self.inputs = StepInputs(llm.engine.runner.limits, llm.device)

    def __call__(self, requests, n):
        drafts, current = [[] for _ in requests], [r.output[-1] for r in requests]
        for i in range(max(n)):
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
                self.llm.engine.cache,
                self.llm.engine.runner.backend,
            )
            with torch.inference_mode(), forward_context(GraphMode.NONE, BatchDescriptor(m), meta):
                hidden = self.llm.engine.model(
                    self.inputs.input_ids[:m], self.inputs.positions[:m], self.layers
                )
                tokens = self.llm.engine.model.compute_logits(hidden).argmax(-1).tolist()
            for j, t in zip(active, tokens, strict=True):
                drafts[j].append(t)
                current[j] = t
        return drafts


def check_drafts_against(reference, llm):
    """Makes ``llm``'s scheduler draft with both its proposer and ``reference`` and assert
    they agree; returns the list of draft sizes compared (grows as ``llm`` runs)."""
    loop = llm.engine.scheduler.propose
    compared = []

    def both(requests, n):
        # The reference runs first; its K/V writes are the loop's, so the loop sees the
        # cache it would have seen alone.
        want = reference(requests, n)
        got = loop(requests, n)
        compared.append(sum(n))
        assert got == want
        return got

    llm.engine.scheduler.propose = both
    return compared
