"""A batched greedy / temperature / top-p sampler over ``core.params.SamplingParams``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ostinato.engine.core.transfer import to_device_split
from ostinato.engine.sample.adjust import Penalties, count_tokens, penalized
from ostinato.engine.sample.greedy import greedy_tokens


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    generator: torch.Generator | None = None,
    all_greedy: bool | None = None,
    seeded: Sequence[tuple[int, int] | None] | Seeds = (),
    cut: bool = True,
    penalties: Penalties | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits`` (``[rows, vocab]``, any float dtype; the
    softmax runs in float32).

    Rows with temperature 0 take the argmax; others sample from the softmax at that
    temperature restricted to the smallest set of most likely tokens whose probability
    reaches top_p (the tokens tied with its least likely one kept too). ``all_greedy``:
    whether every temperature is 0, when the caller knows (else it is read from the
    device, which waits for it). ``seeded[i] = (seed, index)``: row i draws from a key
    of its own, made of ``seed`` and the index of the token drawn, so its token depends on
    its own logits and seed only (``None`` or absent: the row's draws come from
    ``generator``); or the same on the device (``Seeds``, as a graph holds it; with no
    mask every row's key, drawn by the caller, and ``generator`` is not used).
    ``cut=False``: the caller knows every top_p is 1, so no sort over the vocabulary
    where the step samples with torch (the same tokens). ``penalties``: sample from
    ``adjust.penalized(logits, ...)`` instead (on CUDA inside the first sampling kernel),
    and count each row's token in its row of the penalties' table
    (``adjust.count_tokens``; on CUDA in the last sampling or argmax kernel, so nothing
    is counted inside ``compile_ahead()``, where no kernel runs). ``out``: the tokens
    are written there and it is returned (int64 ``[rows]``; on CUDA the sampling kernels
    write it themselves).

    On CUDA the sampling kernels draw (``kernels.sampling``): each row's draws come from a
    key, the seeded rows' own or one drawn from ``generator``, so a graph replay takes
    the tokens an eager call takes from the same generator state. Elsewhere torch ops.
    """
    if all_greedy is None:
        all_greedy = not bool((temperatures > 0).any())
    drawn = (temperatures, top_ps, generator, all_greedy, seeded, cut)
    if penalties is None or (logits.is_cuda and not all_greedy):
        # (the sampling kernels apply the penalties and count the draws themselves)
        operands = penalties.operands() if penalties is not None else None
        return _drawn(logits, *drawn, operands, out)
    adjusted, counts = penalized(logits, *penalties.operands()), (penalties.table, penalties.rows)
    if all_greedy:  # (on CUDA the argmax's second kernel counts)
        return greedy_tokens(adjusted, out=out, counts=counts)
    tokens = _drawn(adjusted, *drawn, None, out)
    count_tokens(*counts, tokens)
    return tokens


def _drawn(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    generator: torch.Generator | None,
    all_greedy: bool,
    seeded: Sequence[tuple[int, int] | None] | Seeds,
    cut: bool,
    operands: tuple[torch.Tensor | None, ...] | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """``sample``'s draw; ``operands`` (CUDA, a sampled step only): the penalties that
    ``kernels.sampling.sample_rows`` applies and counts."""
    if all_greedy:
        return _into(out, greedy_tokens(logits))
    seeds = seeded if isinstance(seeded, Seeds) else seeds_on(seeded, logits.device)
    if logits.is_cuda:
        from ostinato.engine.kernels.sampling import sample_rows

        keys = row_keys(seeds, logits, generator)
        return sample_rows(logits, temperatures, top_ps, keys, operands, out)
    greedy = greedy_tokens(logits)
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits.float() / t[:, None], dim=-1)
    race = _races(probs, seeds, generator)
    if cut:
        probs = torch.where(nucleus(probs, top_ps), probs, torch.zeros_like(probs))
    choice = (probs / race).argmax(dim=-1)
    return _into(out, torch.where(temperatures > 0, choice, greedy))


def _races(
    probs: torch.Tensor, seeds: Seeds | None, generator: torch.Generator | None
) -> torch.Tensor:
    """The exponential race's ``E ~ Exp(1)`` per entry of ``probs``: a keyed row's from
    its key, the others' from ``generator``. Its argmax of p / E picks token i with
    probability p_i / sum(p); unlike torch.multinomial it never waits for the device,
    and it is made of ops a graph can hold."""
    if seeds is not None and seeds.mask is None:  # (every row keyed: no generator draw)
        return seeded_races(seeds.keys, probs.shape[1])
    race = torch.empty_like(probs).exponential_(generator=generator)
    if seeds is None:
        return race
    return torch.where(seeds.mask[:, None], seeded_races(seeds.keys, race.shape[1]), race)


def _into(out: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens``, or ``out`` holding them."""
    return tokens if out is None else out.copy_(tokens)


def row_keys(
    seeds: Seeds | None, logits: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """Each row's 32-bit key for ``seeded_races``' draws (int64 ``[rows]`` on the
    logits' device): a seeded row's own, else one drawn from ``generator``."""
    if seeds is not None and seeds.mask is None:
        return seeds.keys
    rows = logits.shape[0]
    drawn = torch.randint(0, 1 << 32, (rows,), generator=generator, device=logits.device)
    return drawn if seeds is None else torch.where(seeds.mask, seeds.keys, drawn)


def nucleus(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Where each row keeps a token (``[rows, vocab]`` bool, ``probs``' order): the mass
    of the tokens more likely than it is below the row's top_p."""
    ordered, order = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(dim=-1) - ordered
    # Tied tokens all count the mass strictly above them: that before the tie's first.
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    at = torch.arange(ordered.shape[1], device=probs.device).expand_as(ordered)
    first = torch.where(starts, at, torch.zeros_like(at)).cummax(dim=-1).values
    keep = before.gather(1, first) < top_ps[:, None]
    return torch.zeros_like(keep).scatter(1, order, keep)


@dataclass(frozen=True)
class Seeds:
    """Per row of a step, on the device: ``keys`` (int64, ``seeded_races``' row keys) and
    ``mask`` (bool: the row draws from its key, not the generator; None: every row
    does, and nothing is drawn from the generator)."""

    keys: torch.Tensor
    mask: torch.Tensor | None


def seeds_on(seeded: Sequence[tuple[int, int] | None], device: torch.device) -> Seeds | None:
    """``sample``'s ``seeded`` list as ``Seeds`` on ``device``, in one copy (None where
    no row is seeded)."""
    if not any(key is not None for key in seeded):
        return None
    keys, mask = row_keys_and_mask(seeded)
    keys_t, mask_t = to_device_split([keys, mask], torch.long, device)
    return Seeds(keys_t, mask_t.bool())


def row_keys_and_mask(seeded: Sequence[tuple[int, int] | None]) -> tuple[list[int], list[int]]:
    """Per row, its ``seeded_races`` key (0 unseeded) and 1 where seeded, else 0."""
    mixed = iter(_row_keys([key for key in seeded if key is not None]))  # (one pass)
    keys = [next(mixed) if key is not None else 0 for key in seeded]
    return keys, [int(key is not None) for key in seeded]


def top_p_cut(temperatures: Sequence[float], top_ps: Sequence[float]) -> bool:
    """``sample``'s ``cut``: whether a sampled row (temperature above 0) has top_p < 1."""
    return any(t > 0 and p < 1 for t, p in zip(temperatures, top_ps, strict=True))


_MASK = (1 << 32) - 1
_MASK64 = (1 << 64) - 1


def seeded_races(row_keys: torch.Tensor, n: int) -> torch.Tensor:
    """``[len(row_keys), n]`` Exp(1) draws, row i depending on ``row_keys[i]`` alone (a
    ``_row_keys`` value, int64 on the draws' device), the same on every device. A
    counter-based hash of (row key, column) in a few element-wise ops for all rows at
    once (a generator per row cost two launches and a host round of its own per row).
    The arithmetic stays below 2**63 in int64, so no op overflows."""
    x = row_keys[:, None]
    x = (x + torch.arange(n, device=row_keys.device) * 0x9E3779B1) & _MASK
    for _ in range(2):  # two rounds of a 32-bit integer hash (multiplier below 2**31)
        x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK
    x = (x >> 16) ^ x
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return -torch.log(u)


def _row_keys(keys: Sequence[tuple[int, int]]) -> list[int]:
    """A 32-bit key per (seed, index): ``seeded_races``' rows (``row_keys_array``'), of
    integers of any size (the mix is modulo 2**64, so each is taken modulo 2**64 first)."""
    seeds = np.array([seed & _MASK64 for seed, _ in keys], dtype=np.uint64)
    indices = np.array([index & _MASK64 for _, index in keys], dtype=np.uint64)
    return row_keys_array(seeds, indices).tolist()


def row_keys_array(seeds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The key of each (``seeds[i]``, ``indices[i]``) (uint64 arrays; the keys as uint64
    below 2**32): SplitMix64's finaliser of ``seed * golden + index``, its low 32 bits.
    numpy's uint64 products wrap modulo 2**64, as the mix asks, at a few operations for
    all rows."""
    with np.errstate(over="ignore"):
        z = seeds * np.uint64(0x9E3779B97F4A7C15) + indices
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & np.uint64(_MASK)
