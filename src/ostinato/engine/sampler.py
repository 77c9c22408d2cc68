"""Sampling parameters and a batched greedy / temperature / top-p sampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy. Validated on construction."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits`` (``[rows, vocab]``, float32).

    Rows with temperature 0 take the argmax; others sample from the softmax at that
    temperature restricted to the smallest set of tokens whose probability reaches top_p.
    """
    greedy = logits.argmax(dim=-1)
    if not bool((temperatures > 0).any()):
        return greedy
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits / t[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # Keep a token if the mass before it is still below top_p (the first is always kept).
    keep = (sorted_p.cumsum(dim=-1) - sorted_p) < top_ps[:, None]
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    choice = torch.multinomial(sorted_p, 1, generator=generator).squeeze(1)
    sampled = order.gather(1, choice[:, None]).squeeze(1)
    return torch.where(temperatures > 0, sampled, greedy)
