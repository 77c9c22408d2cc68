"""Host values to the device without waiting for it."""

from __future__ import annotations

import torch


def to_device(
    values: list[int] | list[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a tensor on ``device``. On CUDA the copy is asynchronous (through
    pinned memory), so the host never waits here for the device's queued work: a step's
    only wait is reading back its tokens, which is where a dead peer is noticed."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device_split(
    lists: list[list[int]] | list[list[float]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Each of ``lists`` as a tensor on ``device``, through one copy (``to_device``) of
    them all: views of one tensor, in order. A copy costs about as much host time as a
    few kernel launches, whatever its size."""
    flat = [v for values in lists for v in values]
    return list(to_device(flat, dtype, device).split([len(v) for v in lists]))
