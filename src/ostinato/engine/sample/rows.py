"""``StepRows``: what a step's sampling reads of its requests' parameters, row by row,
made once for a run of steps over the same requests in the same order.

A steady decode schedules the last step's requests again, in the same order, and a
request's ``SamplingParams`` never change: so the per-row values (temperatures, top-p,
penalties, seeds) and the step-wide answers (all greedy? adjusted? seeded? top-p cut?
log probabilities asked?) are the last step's. At 64 rows on an H200's host, making
them anew each step, with a sampling graph's staging and seed keys, took some 200 µs
of a step that the device runs in 1.4 ms, and the step waited for the host."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ostinato.engine.core.params import SamplingParams
from ostinato.engine.sample.logprobs import wanted
from ostinato.engine.sample.sampler import row_keys_array, top_p_cut


@dataclass(frozen=True, eq=False)
class StepRows:
    """Per row of a step (``params`` in the step's order): ``floats`` (``[4, rows]``
    float32: temperature, top-p, presence and frequency penalties), ``seeds`` (uint64: a
    sampled row's seed, else 0) and ``seeded_rows`` (int64: 1 where a sampled row has a
    seed); for the whole step: every row greedy, any row's logits adjusted (bias or
    penalties), any sampled row seeded, a sampled row's top-p below 1 (``cut``), the
    most log-probability alternatives a row asked (None: none asked), and each row's
    logit bias (``bias``, which a sampling graph's bias buffer is keyed on)."""

    params: tuple[SamplingParams, ...]
    floats: np.ndarray
    seeds: np.ndarray
    seeded_rows: np.ndarray
    all_greedy: bool
    adjusted: bool
    seeded: bool
    cut: bool
    logprobs: int | None
    bias: tuple

    @staticmethod
    def of(params: Sequence[SamplingParams]) -> StepRows:
        temperatures = [p.temperature for p in params]
        top_ps = [p.top_p for p in params]
        floats = np.array(
            [
                temperatures,
                top_ps,
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
            ],
            dtype=np.float32,
        ).reshape(4, len(params))
        seeded = [p.seed is not None and not p.greedy for p in params]
        seeds = np.array([p.seed if s else 0 for p, s in zip(params, seeded, strict=True)])
        return StepRows(
            tuple(params),
            floats,
            seeds.astype(np.uint64),
            np.array(seeded, dtype=np.int64),
            all(p.greedy for p in params),
            any(p.adjusts_logits for p in params),
            any(seeded),
            top_p_cut(temperatures, top_ps),
            wanted(params),
            tuple(p.logit_bias for p in params),
        )

    def holds(self, params: Sequence[SamplingParams]) -> bool:
        """Whether these are ``params``' rows: the same objects in the same order (a
        request's parameters are never changed once it is made)."""
        return len(params) == len(self.params) and all(map(operator.is_, params, self.params))

    def keys(self, indices: Sequence[int]) -> np.ndarray:
        """Each row's key of its draws for the tokens at ``indices`` (the index of each
        row's token in its sequence): ``sampler.row_keys_array`` of a seeded row's seed,
        0 for the others (``sampler.row_keys_and_mask``' keys)."""
        keys = row_keys_array(self.seeds, np.asarray(self._indexed(indices), dtype=np.uint64))
        return np.where(self.seeded_rows.astype(bool), keys, np.uint64(0)).astype(np.int64)

    def _indexed(self, indices: Sequence[int]) -> Sequence[int]:
        """``indices``, one a row, or ``ValueError`` naming what a seeded row needs."""
        if len(indices) != len(self.params):
            raise ValueError(
                f"StepSampler: seeded requests need the index of each token ({len(indices)} "
                f"indices for {len(self.params)} requests)"
            )
        return indices
