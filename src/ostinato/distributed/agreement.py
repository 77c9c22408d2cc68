"""Data parallelism: before every step the replicas agree, in one small collective, on
the runtime mode (the lowest of theirs), the padded size (the largest of theirs) and
whether the step is a uniform decode (only if it is on every replica), so graphs that hold
collectives replay in lock-step; a replica without work runs a dummy step of that size.
They also agree on whether the step is split into micro-batches: either every replica with
work splits it (each proposed it and keeps real tokens in both halves of the agreed size)
or none does.

A replica with no work proposes ``idle_proposal()``, which constrains nothing; when every
replica is idle the agreed size is 0 and the replicas stop together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ostinato.distributed.collectives import on_group_device
from ostinato.modes import GraphMode

_RANK = {GraphMode.NONE: 0, GraphMode.PIECEWISE: 1, GraphMode.FULL: 2}
_MODE = {v: k for k, v in _RANK.items()}


@dataclass(frozen=True)
class StepAgreement:
    """What every replica runs this step: ``mode``, ``num_tokens`` (padded),
    ``uniform_decode``, the padded token count each replica proposed (0: no work), and
    ``micro_batch``: whether every replica with work splits the step into two
    micro-batches."""

    mode: GraphMode
    num_tokens: int
    uniform_decode: bool
    tokens_per_rank: tuple[int, ...]
    micro_batch: bool = False


def idle_proposal() -> tuple[GraphMode, int, bool]:
    """What a replica without work proposes: the strongest mode, 0 tokens, uniform."""
    return GraphMode.FULL, 0, True


def agree_on_step(
    mode: GraphMode,
    num_tokens: int,
    group: dist.ProcessGroup | None,
    uniform_decode: bool = False,
    micro_batch: bool = False,
    real_tokens: int = 0,
    can_split: Callable[[int, int], bool] | None = None,
) -> StepAgreement:
    """One all-gather of ``(mode, num_tokens, uniform_decode, micro_batch, real_tokens)``
    over ``group``; every rank gets the same answer. ``mode`` must be a runtime mode
    (NONE, PIECEWISE, FULL); ``micro_batch`` is whether this replica would split its step
    and ``real_tokens`` its unpadded token count; ``can_split(real_tokens, padded)`` says
    whether a replica's step can be split at the agreed padded size (needed with
    ``micro_batch``; the same function on every replica)."""
    if mode not in _RANK:
        raise ValueError(f"mode: {mode.name} is not a runtime mode")
    if micro_batch and can_split is None:
        raise ValueError("micro_batch: needs can_split, the rule every replica splits by")
    if group is None:
        split = micro_batch and can_split is not None and can_split(real_tokens, num_tokens)
        return StepAgreement(mode, num_tokens, uniform_decode, (num_tokens,), split)
    row = [_RANK[mode], num_tokens, int(uniform_decode), int(micro_batch), real_tokens]
    mine = on_group_device(torch.tensor(row, dtype=torch.long), group)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    rows = [t.tolist() for t in gathered]
    lowest = min(r[0] for r in rows)
    uniform = all(r[2] for r in rows)
    padded = max(r[1] for r in rows)
    busy = [r for r in rows if r[1] > 0]
    split = bool(busy) and all(r[3] and can_split and can_split(r[4], padded) for r in busy)
    return StepAgreement(_MODE[lowest], padded, uniform, tuple(r[1] for r in rows), split)
