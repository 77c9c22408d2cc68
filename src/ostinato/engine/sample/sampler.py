"""Sampling parameters and a batched greedy / temperature / top-p sampler."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ostinato.engine.sample.greedy import greedy_tokens
from ostinato.mathutil import is_int

MIN_TEMPERATURE = 1e-5
"""Below this a temperature means greedy (logits of ~100 over it still fit in float32)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy, and so is any temperature below
    ``MIN_TEMPERATURE`` (it is stored as 0: dividing logits by it would overflow float32
    and turn the softmax into NaN). Validated on construction."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

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
            is_int(t) for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids: must be a tuple of ints, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax (temperature 0): the one place that says so."""
        return self.temperature == 0


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    generator: torch.Generator | None = None,
    all_greedy: bool | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits`` (``[rows, vocab]``, any float dtype; the
    softmax runs in float32).

    Rows with temperature 0 take the argmax; others sample from the softmax at that
    temperature restricted to the smallest set of tokens whose probability reaches top_p.
    ``all_greedy``: whether every temperature is 0, when the caller knows (else it is
    read from the device, which waits for it).
    """
    greedy = greedy_tokens(logits)
    if all_greedy is None:
        all_greedy = not bool((temperatures > 0).any())
    if all_greedy:
        return greedy
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits.float() / t[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # Keep a token if the mass before it is still below top_p (the first is always kept).
    keep = (sorted_p.cumsum(dim=-1) - sorted_p) < top_ps[:, None]
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    # The exponential race: argmax of p / E, E ~ Exp(1) i.i.d., picks token i with
    # probability p_i / sum(p). Unlike torch.multinomial it never waits for the device,
    # and it is made of ops a graph can hold.
    race = torch.empty_like(sorted_p).exponential_(generator=generator)
    choice = (sorted_p / race).argmax(dim=-1)
    sampled = order.gather(1, choice[:, None]).squeeze(1)
    return torch.where(temperatures > 0, sampled, greedy)
