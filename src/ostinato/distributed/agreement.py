"""Data parallelism: before every step the replicas agree, in one small collective, on
the runtime mode (the lowest of theirs) and the padded size (the largest of theirs), so
graphs that hold collectives replay in lock-step; a replica without work runs a dummy
step of that size."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ostinato.modes import GraphMode

_RANK = {GraphMode.NONE: 0, GraphMode.PIECEWISE: 1, GraphMode.FULL: 2}
_MODE = {v: k for k, v in _RANK.items()}


@dataclass(frozen=True)
class StepAgreement:
    """What every replica runs this step: ``mode``, ``num_tokens`` (padded), and the
    token count of each replica (0 for one without work)."""

    mode: GraphMode
    num_tokens: int
    tokens_per_rank: tuple[int, ...]


def agree_on_step(
    mode: GraphMode, num_tokens: int, group: dist.ProcessGroup | None
) -> StepAgreement:
    """One all-gather of ``(mode, num_tokens)`` over ``group``; every rank gets the same
    answer. ``mode`` must be a runtime mode (NONE, PIECEWISE, FULL)."""
    if mode not in _RANK:
        raise ValueError(f"mode: {mode.name} is not a runtime mode")
    if group is None:
        return StepAgreement(mode, num_tokens, (num_tokens,))
    mine = torch.tensor([_RANK[mode], num_tokens], dtype=torch.long)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    rows = [t.tolist() for t in gathered]
    lowest = min(r[0] for r in rows)
    return StepAgreement(_MODE[lowest], max(r[1] for r in rows), tuple(r[1] for r in rows))
