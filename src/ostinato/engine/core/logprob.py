"""``TokenLogprob``: a generated token's log probability, with its most likely
alternatives', as ``SamplingParams(logprobs=k)`` asks (``sample.step_sampler`` computes
them, the scheduler records them with the tokens)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """``logprob``: the natural log of the probability the model gave ``token_id``: the
    log-softmax of its raw logits, in float32 (before temperature, top-p, bias and
    penalties, as vLLM reports them by default). ``top``: the ``k`` most likely tokens'
    (id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
