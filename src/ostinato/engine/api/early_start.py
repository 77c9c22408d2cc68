"""What an engine's process starts on threads before it imports torch, where the engine
will run on a GPU: the device's CUDA context (``ostinato.early_context``) and Triton's
once-a-process set-up (``kernels.triton_warmup``). Imports neither torch nor Triton."""

from __future__ import annotations

from ostinato import early_context
from ostinato.engine.kernels import triton_warmup


def start_early(device: object) -> bool:
    """Starts both for an engine whose ``device`` is this (a string, a ``torch.device``
    or None, the engine's default); False where it names no CUDA device."""
    index = early_context.device_index(device)
    if index is None:
        return False
    early_context.start(index, also=triton_warmup.warm)
    return True
