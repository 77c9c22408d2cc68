"""Tensor-parallel collectives that run eagerly, inside captured CUDA graphs, and inside
``torch.compile``d pieces (functional collectives: Dynamo traces them; they are not
splitting points of the piecewise backend)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# ``all_gather_single`` is the newer name (``all_gather_tensor`` warns in torch 2.13).
_all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)


def on_group_device(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``t`` (a small host tensor to exchange) where ``group``'s backend communicates
    from: the current CUDA device for NCCL, else where it is."""
    return t.cuda() if dist.get_backend(group) == "nccl" else t


def largest_over_group(
    rows: list[list[float]], group: dist.ProcessGroup | None
) -> list[list[float]]:
    """Each value of ``rows`` replaced by the largest any rank of ``group`` holds at its
    place (every rank calls this with rows of the same shape), so that timings measured
    on each rank become the slowest rank's and every rank decides alike; ``rows`` as
    they are without a group."""
    if group is None or not rows:
        return rows
    t = on_group_device(torch.tensor(rows, dtype=torch.float64), group)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def every_rank(holds: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether ``holds`` is true on every rank of ``group`` (this rank's value alone
    without a group): where ranks read a cached choice, they use it only where all of
    them found it, else all of them measure."""
    missing = largest_over_group([[float(not holds)]], group)
    return missing[0][0] == 0.0


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of ``x`` over ``group`` (``x`` itself without a group)."""
    if group is None:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


def all_gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along the last dimension, in rank
    order (``x`` itself without a group)."""
    if group is None:
        return x
    size = dist.get_world_size(group)
    gathered = funcol.wait_tensor(_all_gather(x.contiguous(), 0, group))
    # [size * rows, cols] -> [rows, size * cols]
    return torch.cat(gathered.chunk(size, dim=0), dim=-1)
