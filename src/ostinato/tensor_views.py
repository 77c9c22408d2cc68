"""Non-owning tensor views: read a graph's output without keeping its memory alive."""

from __future__ import annotations

from typing import Any

import torch


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor with ``t``'s data pointer, shape, strides and dtype that owns nothing.

    Guarantees: reads and writes go to ``t``'s memory; dropping every other reference to
    ``t`` frees that memory back to its allocator (here: the graph pool), after which the
    view may see other data. Safe for a graph output read after each replay, since the
    pool keeps the block reserved for as long as the graph lives.
    """
    storage = torch._C._construct_storage_from_data_pointer(
        t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes()
    )
    view = torch.empty(0, dtype=t.dtype, device=t.device)
    return view.set_(storage, t.storage_offset(), t.size(), t.stride())


def weak_ref_tensors(obj: Any) -> Any:
    """``weak_ref_tensor`` applied to a tensor, or to each tensor of a list or tuple."""
    if isinstance(obj, torch.Tensor):
        return weak_ref_tensor(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(weak_ref_tensors(x) for x in obj)
    return obj
