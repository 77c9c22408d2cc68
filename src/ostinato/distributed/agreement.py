"""Data parallelism: before every step the replicas agree, in one small collective, on
the runtime mode (the lowest of theirs), the padded size (the largest of theirs) and
whether the step is a uniform decode (only if it is on every replica), so graphs that hold
collectives replay in lock-step; a replica without work runs a dummy step of that size.

A replica with no work proposes ``idle_proposal()``, which constrains nothing; when every
replica is idle the agreed size is 0 and the replicas stop together."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ostinato.modes import GraphMode

_RANK = {GraphMode.NONE: 0, GraphMode.PIECEWISE: 1, GraphMode.FULL: 2}
_MODE = {v: k for k, v in _RANK.items()}


@dataclass(frozen=True)
class StepAgreement:
    """What every replica runs this step: ``mode``, ``num_tokens`` (padded),
    ``uniform_decode``, and the padded token count each replica proposed (0: no work)."""

    mode: GraphMode
    num_tokens: int
    uniform_decode: bool
    tokens_per_rank: tuple[int, ...]


def idle_proposal() -> tuple[GraphMode, int, bool]:
    """What a replica without work proposes: the strongest mode, 0 tokens, uniform."""
    return GraphMode.FULL, 0, True


def agree_on_step(
    mode: GraphMode,
    num_tokens: int,
    group: dist.ProcessGroup | None,
    uniform_decode: bool = False,
) -> StepAgreement:
    """One all-gather of ``(mode, num_tokens, uniform_decode)`` over ``group``; every rank
    gets the same answer. ``mode`` must be a runtime mode (NONE, PIECEWISE, FULL)."""
    if mode not in _RANK:
        raise ValueError(f"mode: {mode.name} is not a runtime mode")
    if group is None:
        return StepAgreement(mode, num_tokens, uniform_decode, (num_tokens,))
    mine = torch.tensor([_RANK[mode], num_tokens, int(uniform_decode)], dtype=torch.long)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    rows = [t.tolist() for t in gathered]
    lowest = min(r[0] for r in rows)
    uniform = all(r[2] for r in rows)
    return StepAgreement(_MODE[lowest], max(r[1] for r in rows), uniform, tuple(r[1] for r in rows))
