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
