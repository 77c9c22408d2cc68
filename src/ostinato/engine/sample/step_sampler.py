"""The one owner of how a step's tokens are chosen, decided once per step from what the
step produced (``StepOutput``): the decode graph's own argmax when every request is
greedy (in FULL mode the greedy graph's), the sampling graph of the step's size when one
was captured, eager sampling otherwise, and verification when the step checks drafts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ostinato.engine.core.params import SamplingParams
from ostinato.engine.core.scheduler import ScheduledBatch, ScheduledRequest
from ostinato.engine.core.transfer import to_device, to_device_split
from ostinato.engine.sample.adjust import (
    OutputCounts,
    Pending,
    StepCounts,
    eager_adjusted,
)
from ostinato.engine.sample.graph_sampler import GraphSampler
from ostinato.engine.sample.greedy import greedy_tokens
from ostinato.engine.sample.logprobs import StepLogprobs
from ostinato.engine.sample.rows import StepRows
from ostinato.engine.sample.sampler import Seeds, sample
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


@dataclass(frozen=True)
class _Prepared:
    """What ``prepare`` made for a step: its rows and counts, each row's key (``keyed``
    sampling; else the seeded rows' keys; None where nothing draws), and whether its
    values were copied for a sampling graph."""

    rows: StepRows
    counts: StepCounts | None
    keys: np.ndarray | None
    staged: bool


class StepSampler:
    """Turns a ``StepOutput`` into tokens. Guarantees: an all-greedy step returns the
    argmax (the graph's own where it has one, no second pass over the logits); a
    sampled, biased, penalized or seeded uniform decode step whose logits a sampling
    graph reads samples in that graph; every other step samples eagerly, with the same
    tokens as the graph from the same state; nothing here waits for the device.

    ``keyed`` (on CUDA): each sampled step's rows draw from keys the host takes from a
    stream seeded with ``generator``'s seed (a seeded row from its own), one a row, in
    a graph or eagerly alike, so a graph holds no generator (a registered one cost each
    replay two eager fills and a launch, some 10 µs at 64 rows on an H200) and a padded
    step's tokens are an unpadded eager step's. Elsewhere the unseeded rows draw from
    ``generator`` (the keys' hash costs the CPU four times the exponential draws)."""

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
        self.keyed = device.type == "cuda"
        self.key_stream = np.random.default_rng(generator.initial_seed())
        self._prepared: _Prepared | None = None  # ``prepare``'s, for the coming ``tokens``

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
        takes its rows' keys and copies the per-row values its sampling graph will read,
        so that ``tokens`` only replays it. A copy queued between the step's graphs and
        its sampling graph kept the device idle some 10 µs a step (64 rows on an H200:
        the copy engine's turn after a kernel); here it follows the step's own input
        copies."""
        rows = self.rows(params)
        keys = self._keys(rows, indices)
        sampler = self.graph_sampler
        staged = not (
            sampler is None
            or (rows.all_greedy and not rows.adjusted)
            or len(params) > sampler.floats.shape[1]  # (no sampling graph holds so many)
        )
        if staged:
            assert sampler is not None
            sampler.stage(rows, keys, counts.rows if counts is not None else None)
        self._prepared = _Prepared(rows, counts, keys, staged)

    def _keys(self, rows: StepRows, indices: Sequence[int]) -> np.ndarray | None:
        """A step's keys (int64, below 2**32): ``keyed``, one per row for a step that
        samples, a seeded row's from its seed and the others' from ``key_stream``;
        else the seeded rows' (0 for the others) where a row is seeded; else None."""
        if rows.all_greedy or not (self.keyed or rows.seeded):
            return None
        seeded = rows.keys(indices) if rows.seeded else None
        if not self.keyed:
            return seeded
        drawn = self.key_stream.integers(0, 1 << 32, size=len(rows.params), dtype=np.int64)
        return drawn if seeded is None else np.where(rows.seeded_rows != 0, seeded, drawn)

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
        them, so copy it before the next step. A step with a logit bias or a penalty (or,
        not ``keyed``, a seeded sampled request) replays the sampling graph's adjusted
        variant where there is one. Where ``prepare`` was not called for this step, it is
        called here."""
        rows = self.rows(params)
        if rows.all_greedy and not rows.adjusted:
            return self._greedy(out, len(params))
        prepared, self._prepared = self._prepared, None
        if prepared is None or prepared.rows is not rows or prepared.counts is not counts:
            self.prepare(params, indices, counts)
            prepared, self._prepared = self._prepared, None
        assert prepared is not None
        if prepared.staged and out.graph_size is not None:
            in_graph = self._replayed(rows, out.graph_size)
            if in_graph is not None:
                return in_graph
        temperatures = [p.temperature for p in params]
        top_ps = [p.top_p for p in params]
        temps, tops = to_device_split([temperatures, top_ps], torch.float32, self.device)
        logits, penalties = eager_adjusted(out.logits, params, counts)
        seeds = self._device_seeds(rows, prepared.keys) or ()
        return sample(
            logits, temps, tops, self.generator, rows.all_greedy, seeds, rows.cut, penalties
        )

    def _device_seeds(self, rows: StepRows, keys: np.ndarray | None) -> Seeds | None:
        """``prepare``'s keys on the device for an eager step, in one copy: every row's
        (``keyed``), else the seeded rows' with their mask; None where none was taken."""
        if keys is None:
            return None
        if self.keyed:
            return Seeds(to_device(keys.tolist(), torch.long, self.device), None)
        lists = [keys.tolist(), rows.seeded_rows.tolist()]
        keys_t, mask_t = to_device_split(lists, torch.long, self.device)
        return Seeds(keys_t, mask_t.bool())

    def _replayed(self, rows: StepRows, size: int) -> torch.Tensor | None:
        """The tokens of the sampling graph of ``size`` for ``rows`` (their values
        staged), None where it has none."""
        sampler = self.graph_sampler
        assert sampler is not None
        if rows.adjusted or (rows.seeded and not self.keyed):
            return sampler.sample_adjusted(size, rows)
        return sampler.sample(size, rows)

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
