"""Verification of drafts: which draft tokens a target step keeps, and the token after
them. Greedy requests keep a draft token while it equals the target's argmax; sampled
requests keep it with probability p(d) and otherwise draw from p without d (speculative
sampling with a point-mass draft), so outputs keep their distribution."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ostinato.engine.core.params import SamplingParams
from ostinato.engine.core.scheduler import ScheduledBatch
from ostinato.engine.sample.sampler import sample


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``sample`` draws from for these rows: softmax at the
    temperature, restricted to the smallest top set reaching ``top_p``, renormalised."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(dim=-1) - sorted_p) < params.top_p
    kept = torch.zeros_like(probs).scatter_(-1, order, torch.where(keep, sorted_p, 0.0))
    return kept / kept.sum(dim=-1, keepdim=True)


def verify(
    logits: torch.Tensor,
    step: ScheduledBatch,
    generator: torch.Generator | None,
    greedy: torch.Tensor | None = None,
) -> list[int | list[int]]:
    """Per scheduled request: its sampled token, or for a drafting request the draft
    tokens it keeps followed by one more. ``logits`` has ``1 + len(draft)`` rows per
    request, in order (``ModelRunner.execute``); ``greedy``, if given, is their argmax
    already computed (the verify graph's own)."""
    counts = [1 + len(s.draft) for s in step.scheduled]
    argmax = (greedy if greedy is not None else logits.argmax(dim=-1)).tolist()
    out: list[int | list[int]] = []
    row = 0
    for s, count in zip(step.scheduled, counts, strict=True):
        rows = logits[row : row + count]
        targets = argmax[row : row + count]
        row += count
        p = s.request.params
        if not s.draft:
            out.append(targets[0] if p.greedy else _sample_row(rows[0], p, generator))
        elif p.greedy:
            out.append(_accept_greedy(s.draft, targets))
        else:
            out.append(_accept_sampled(s.draft, filtered_probs(rows, p), generator))
    return out


def accept_greedy(step: ScheduledBatch, targets: Sequence[int]) -> list[list[int]]:
    """``verify`` for a step whose requests are all greedy and all carry drafts, from
    the host copy of its argmax (``1 + len(draft)`` entries per request, in order)."""
    out, row = [], 0
    for s in step.scheduled:
        count = 1 + len(s.draft)
        out.append(_accept_greedy(s.draft, list(targets[row : row + count])))
        row += count
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    t = torch.tensor([p.temperature], device=row.device)
    top = torch.tensor([p.top_p], device=row.device)
    return int(sample(row[None], t, top, generator, all_greedy=False)[0])


def _accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    kept = []
    for d, t in zip(draft, targets, strict=False):
        if d != t:
            break
        kept.append(d)
    return [*kept, targets[len(kept)]]


def _accept_sampled(
    draft: list[int], probs: torch.Tensor, generator: torch.Generator | None
) -> list[int]:
    device = probs.device
    uniforms = torch.rand(len(draft), generator=generator, device=device).tolist()
    kept = []
    for i, d in enumerate(draft):
        if uniforms[i] < float(probs[i, d]):
            kept.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # p was a point mass on d: the draw is d
            return [*kept, d]
        token = torch.multinomial(residual, 1, generator=generator)
        return [*kept, int(token)]
    final = torch.multinomial(probs[len(draft)], 1, generator=generator)
    return [*kept, int(final)]
