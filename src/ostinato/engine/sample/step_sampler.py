"""The one owner of how a step's tokens are chosen, decided once per step from what the
step produced (``StepOutput``): the decode graph's own argmax when every request is
greedy (in FULL mode the greedy graph's), the sampling graph of the step's size when one
was captured, eager sampling otherwise, and verification when the step checks drafts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ostinato.engine.core.params import SamplingParams
from ostinato.engine.core.scheduler import ScheduledBatch, ScheduledRequest
from ostinato.engine.core.transfer import to_device_split
from ostinato.engine.sample.adjust import (
    OutputCounts,
    Pending,
    StepCounts,
    adjusted_logits,
    count_tokens,
)
from ostinato.engine.sample.graph_sampler import GraphSampler
from ostinato.engine.sample.greedy import greedy_tokens
from ostinato.engine.sample.logprobs import StepLogprobs
from ostinato.engine.sample.rows import StepRows
from ostinato.engine.sample.sampler import sample
from ostinato.engine.sample.verify import verify


@dataclass(frozen=True)
class StepOutput:
    """What one step of ``ModelRunner.execute`` produced, valid until the next step runs.

    ``logits``: in the model's dtype (``DecoderModel.compute_logits``), one row per
    scheduled request, or ``1 + len(draft)`` rows for a request verifying a draft
    (``[rows, vocab]``). ``greedy``: their argmax computed inside a uniform decode step
    (``[padded]``, padding rows last), else None. ``graph_size``: the size of the
    sampling graph that reads these logits where they are in its static input (the
    uniform decode graph the step replayed, or in FULL mode the buffer the LM head
    wrote after the mixed graph), else None."""

    logits: torch.Tensor
    greedy: torch.Tensor | None = None
    graph_size: int | None = None


class StepSampler:
    """Turns a ``StepOutput`` into tokens. Guarantees: an all-greedy step returns the
    argmax (the graph's own where it has one, no second pass over the logits); a
    sampled, biased, penalized or seeded uniform decode step whose logits a sampling
    graph reads samples in that graph; every other step samples eagerly from
    ``generator``, with the same tokens at a captured size; nothing here waits for the
    device."""

    def __init__(
        self,
        generator: torch.Generator,
        device: torch.device,
        counts: OutputCounts,
        graph_sampler: GraphSampler | None = None,
    ) -> None:
        self.generator, self.device = generator, device
        self.counts = counts  # the penalties' output counts, read by the sampling graphs
        self.graph_sampler = graph_sampler  # the sampling graphs, one per decode size
        self._rows: StepRows | None = None  # the last step's (``rows``)
        # The rows and counts whose values ``prepare`` copied for the coming ``tokens``.
        self._staged: tuple[StepRows, StepCounts | None] | None = None

    def output_counts(
        self, scheduled: Sequence[ScheduledRequest], pending: Pending | None
    ) -> StepCounts | None:
        """The step's rows of the penalties' output counts (``adjust.OutputCounts``),
        None where no request is penalized (``pending``: the last step's tokens still
        on the device). ``tokens`` counts the tokens it draws for them."""
        if not any(s.request.params.penalized for s in scheduled):
            return None
        return self.counts.for_step(scheduled, pending)

    def rows(self, params: Sequence[SamplingParams]) -> StepRows:
        """``StepRows`` of ``params``: the last step's where they hold the same requests
        in the same order (a steady decode), else made anew."""
        rows = self._rows
        if rows is None or not rows.holds(params):
            rows = self._rows = StepRows.of(params)
        return rows

    def prepare(
        self,
        params: Sequence[SamplingParams],
        indices: Sequence[int] = (),
        counts: StepCounts | None = None,
    ) -> None:
        """Before a step's graphs are queued (``tokens``' arguments for the same step):
        copies the per-row values its sampling graph will read, so that ``tokens`` only
        replays it. A copy queued between the step's graphs and its sampling graph kept
        the device idle some 10 µs a step (64 rows on an H200: the copy engine's turn
        after a kernel); here it follows the step's own input copies."""
        self._staged = None
        rows = self.rows(params)
        sampler = self.graph_sampler
        if sampler is None or (rows.all_greedy and not rows.adjusted):
            return
        if len(params) > sampler.floats.shape[1]:
            return  # (no sampling graph holds so many rows)
        keys = rows.keys(indices) if rows.seeded else None
        sampler.stage(rows, keys, counts.rows if counts is not None else None)
        self._staged = (rows, counts)

    def tokens(
        self,
        params: Sequence[SamplingParams],
        out: StepOutput,
        indices: Sequence[int] = (),
        counts: StepCounts | None = None,
    ) -> torch.Tensor:
        """One token per request of the step (``params`` in the step's order; ``indices``:
        the index in its sequence of each token drawn, which a request's ``seed`` is
        mixed with; ``counts``: ``output_counts``', where a request is penalized, whose
        rows then count the tokens drawn); a view of a static buffer where a graph chose
        them, so copy it before the next step. A step with a seeded sampled request, a
        logit bias or a penalty replays the sampling graph's adjusted variant where there
        is one. Where ``prepare`` was not called for this step, it is called here."""
        rows = self.rows(params)
        if rows.all_greedy and not rows.adjusted:
            return self._greedy(out, len(params))
        sampler, size = self.graph_sampler, out.graph_size
        staged, self._staged = self._staged, None
        if sampler is not None and size is not None:
            if staged is None or staged[0] is not rows or staged[1] is not counts:
                self.prepare(params, indices, counts)
                staged, self._staged = self._staged, None
            if staged is not None:
                adjusted = rows.adjusted or rows.seeded
                replay = sampler.sample_adjusted if adjusted else sampler.sample
                in_graph = replay(size, rows)
                if in_graph is not None:
                    return in_graph
        temperatures = [p.temperature for p in params]
        top_ps = [p.top_p for p in params]
        temps, tops = to_device_split([temperatures, top_ps], torch.float32, self.device)
        logits = adjusted_logits(out.logits, params, counts) if rows.adjusted else out.logits
        seeded = rows.seeded_list(indices)
        tokens = sample(logits, temps, tops, self.generator, rows.all_greedy, seeded, rows.cut)
        if counts is not None:
            count_tokens(counts.table, counts.device_rows, tokens)
        return tokens

    def _greedy(self, out: StepOutput, n: int) -> torch.Tensor:
        """The argmax of an all-greedy step without adjustments: the step's own, else
        the greedy graph of its size, else eager (no per-row values to copy)."""
        if out.greedy is not None:
            return out.greedy
        if self.graph_sampler is not None and out.graph_size is not None:
            in_graph = self.graph_sampler.greedy(out.graph_size, n)
            if in_graph is not None:
                return in_graph
        return greedy_tokens(out.logits)

    def logprobs(
        self, params: Sequence[SamplingParams], out: StepOutput, tokens: torch.Tensor
    ) -> StepLogprobs | None:
        """The log probabilities of the step's ``tokens`` (``tokens``' result) and their
        alternatives, from the raw logits, where a request asked (``StepLogprobs``);
        None where none did. Queued on the device, like the tokens."""
        k = self.rows(params).logprobs
        if k is None:
            return None
        if self.graph_sampler is not None and out.graph_size is not None:
            in_graph = self.graph_sampler.logprobs(out.graph_size, tokens, k)
            if in_graph is not None:
                return in_graph
        return StepLogprobs.of(out.logits, tokens, k)

    def verify(self, step: ScheduledBatch, out: StepOutput) -> list[int | list[int]]:
        """Per request of a verify step: its sampled token, or the draft tokens it keeps
        followed by one more (``sample.verify``)."""
        return verify(out.logits, step, self.generator, out.greedy)
