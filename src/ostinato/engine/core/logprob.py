"""``TokenLogprob``: a generated token's log probability, with its most likely
alternatives', as ``SamplingParams(logprobs=k)`` asks (``sample.step_sampler`` computes
them, the scheduler records them with the tokens)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprob:
    """``logprob``: the natural log of the probability the model gave ``token_id``: the
    log-softmax of its raw logits, in float32 (before temperature, top-p, bias and
    penalties, as vLLM reports them by default). ``top_ids`` / ``top_logprobs``: the
    ``k`` most likely tokens' ids and log probabilities, most likely first; ``top``
    pairs them.

    Made by the engine once per token and row, so made cheaply: two tuples, not a
    tuple of pairs, and not frozen (64 rows of 20 alternatives: made in 10 µs against 81
    on the development CPU, ``benchmarks/results/start_and_steps_first_h200``; in a
    profile at 64 rows on the H200, making them took longer than the log-probability
    kernels). Read it; nothing in the engine changes one once made."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    @property
    def top(self) -> tuple[tuple[int, float], ...]:
        """The alternatives as ``(id, logprob)`` pairs, most likely first."""
        return tuple(zip(self.top_ids, self.top_logprobs, strict=True))
