"""The platform layer and its one accessor, ``current_platform()``.

Selection: the ``OSTINATO_PLATFORM`` environment variable (``cuda``, ``npu`` or ``cpu``)
if set, else CUDA/ROCm when ``torch.cuda.is_available()``, else Ascend when torch_npu
is installed and sees a device, else CPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch

from ostinato.errors import PlatformError
from ostinato.platform.base import Graph, Platform, exclusive_device
from ostinato.platform.cpu import CpuPlatform

__all__ = [
    "Graph",
    "Platform",
    "CpuPlatform",
    "current_platform",
    "exclusive_device",
    "load_platform",
    "platform_for_device",
    "use_platform",
]

_platform: Platform | None = None


def load_platform(name: str) -> Platform:
    """The platform called ``name``; raises ``PlatformError`` if it is not usable here."""
    key = name.strip().lower()
    if key == "cpu":
        return CpuPlatform()
    if key in ("cuda", "rocm"):
        if not torch.cuda.is_available():
            raise PlatformError(
                f"platform {name!r} asked for, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); install a CUDA/ROCm build or use 'cpu'"
            )
        from ostinato.platform.cuda import CudaPlatform

        return CudaPlatform()
    if key == "npu":
        from ostinato.platform.npu import NpuPlatform  # raises PlatformError without torch_npu

        return NpuPlatform()
    raise PlatformError(f"unknown platform {name!r}; use 'cuda', 'npu' or 'cpu'")


def _detect() -> Platform:
    forced = os.environ.get("OSTINATO_PLATFORM")
    if forced:
        return load_platform(forced)
    if torch.cuda.is_available():
        return load_platform("cuda")
    if importlib.util.find_spec("torch_npu") is not None:
        with contextlib.suppress(PlatformError):
            platform = load_platform("npu")
            if torch.npu.is_available():
                return platform
    return CpuPlatform()


def current_platform() -> Platform:
    """The process's platform, detected once on first use."""
    global _platform
    if _platform is None:
        _platform = _detect()
    return _platform


def platform_for_device(device: torch.device) -> Platform:
    """The platform that runs tensors on ``device``: the CPU platform (no graphs) for a
    CPU device even on a GPU host, else the current platform."""
    return CpuPlatform() if device.type == "cpu" else current_platform()


@contextlib.contextmanager
def use_platform(platform: Platform) -> Iterator[Platform]:
    """Makes ``platform`` current inside the block (tests, or forcing CPU on a GPU host)."""
    global _platform
    previous = _platform
    _platform = platform
    try:
        yield platform
    finally:
        _platform = previous
