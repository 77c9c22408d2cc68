"""``SamplingParams``: how a request wants its tokens picked, checked on construction. The
scheduler reads its limits; ``engine.sample`` does the picking."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

from ostinato.mathutil import is_int

MAX_LOGPROBS = 20
"""The most alternatives a token's log probability comes with (OpenAI's top_logprobs)."""

MAX_SAMPLES = 128
"""The most samples one prompt may ask for (``SamplingParams.n``; OpenAI's bound)."""

MIN_TEMPERATURE = 1e-5
"""Below this a temperature means greedy (logits of ~100 over it still fit in float32)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy, and so is any temperature below
    ``MIN_TEMPERATURE`` (it is stored as 0: dividing logits by it would overflow float32
    and turn the softmax into NaN). ``seed``: the request's draws come from it alone (the
    same seed gives the same tokens, alone or batched with any others); None: from the
    engine's generator. ``stop``: strings that end the request where its text reaches
    one (finish reason STOP; the text returned ends before it: ``core.stop_text``).
    ``stop_token_ids``: token ids that end the request with the first of them it
    generates (finish reason STOP; the token is kept in the output, as the EOS is).
    ``logit_bias``: (token id, bias) pairs (a dict is taken too) added to the request's
    logits before its token is picked, each bias in [-100, 100] as OpenAI's.
    ``presence_penalty`` / ``frequency_penalty`` (each in [-2, 2], as OpenAI's): subtracted
    from the logit of every token the request has generated so far, once / once per time
    it was generated (its output only, not its prompt, as vLLM's). ``logprobs``: None,
    or the number (0 to ``MAX_LOGPROBS``) of most likely alternatives to report with each
    generated token's log probability (``core.logprob.TokenLogprob``). ``n``: how many
    samples of the prompt to generate (1 to ``MAX_SAMPLES``); they share the prompt's
    prefill where the scheduler can (``Scheduler.add``), and with a ``seed`` each draws
    from its own (``sample``). Validated on construction."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature: must be a number >= 0, got {self.temperature!r}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids: must be a tuple of token ids (ints >= 0), "
                f"got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop: must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ValueError(f"{name}: must be a number in [-2, 2], got {value!r}")
            object.__setattr__(self, name, float(value))
        k = self.logprobs
        if k is not None and (not is_int(k) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"logprobs: None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed: must be an integer in [0, 2**63) or None, got {self.seed!r}")
        if not is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n: must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")

    def sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` (0 to ``n - 1``) of an ``n``-sample request:
        these with ``n = 1``; sample 0 keeps the seed, each other draws from its own,
        derived from the seed and ``index`` (so the samples differ, and each is
        reproducible)."""
        if not 0 <= index < self.n:
            raise ValueError(f"sample: index must be in [0, {self.n}), got {index}")
        seed = self.seed
        if seed is not None and index:
            seed = (seed + index * 0x9E3779B97F4A7C15) % 2**63  # (the golden-ratio stride)
        return replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax (temperature 0): the one place that says so."""
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a presence or frequency penalty applies."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the request's logits change before its token is picked (bias or
        penalties): its token is then never the model's own argmax."""
        return bool(self.logit_bias) or self.penalized


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs; ``ValueError`` naming a bad one."""
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    if not isinstance(pairs, (tuple, list)):
        raise ValueError(f"logit_bias: (token id, bias) pairs or a dict, got {bias!r}")
    out = {}
    for pair in pairs:
        token, value = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (None, None)
        if not is_int(token) or token < 0 or not _is_real(value) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias: token ids >= 0 with biases in [-100, 100], got {pair!r}")
        out[int(token)] = float(value)
    return tuple(sorted(out.items()))
