"""A batched greedy / temperature / top-p sampler over ``core.params.SamplingParams``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ostinato.engine.sample.greedy import greedy_tokens


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    generator: torch.Generator | None = None,
    all_greedy: bool | None = None,
    seeded: Sequence[tuple[int, int] | None] = (),
) -> torch.Tensor:
    """One token id per row of ``logits`` (``[rows, vocab]``, any float dtype; the
    softmax runs in float32).

    Rows with temperature 0 take the argmax; others sample from the softmax at that
    temperature restricted to the smallest set of tokens whose probability reaches top_p.
    ``all_greedy``: whether every temperature is 0, when the caller knows (else it is
    read from the device, which waits for it). ``seeded[i] = (seed, index)``: row i draws
    from a generator of its own, seeded by ``seed`` and the index of the token drawn, so
    its token depends on its own logits and seed only (``None`` or absent: ``generator``).
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
    for row, key in enumerate(seeded):
        if key is not None:
            race[row] = _seeded_race(*key, race.shape[1], race.device)
    choice = (sorted_p / race).argmax(dim=-1)
    sampled = order.gather(1, choice[:, None]).squeeze(1)
    return torch.where(temperatures > 0, sampled, greedy)


def _seeded_race(seed: int, index: int, n: int, device: torch.device) -> torch.Tensor:
    """``n`` Exp(1) draws that depend on ``seed`` and ``index`` alone."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + index) % (1 << 63))  # (golden-ratio mixing)
    return torch.empty(n, device=device).exponential_(generator=g)
