"""Checks of the engine's scalar options, shared by ``LLM`` and the command line, so that
a bad value is refused with the option's name before anything is loaded."""

from __future__ import annotations

import torch

from ostinato.modes import GraphMode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """The device to run on (default: CUDA when available, else CPU); ``ValueError``
    names a device PyTorch does not know or one this machine lacks."""
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device: {spec!r} is not a device PyTorch knows; use cpu, cuda or cuda:N"
        ) from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device: {device.type!r} is not supported by the engine; use cpu or cuda")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device: {spec!r} asked for, but CUDA is not available here (torch "
            f"{torch.__version__}); use --device cpu or a CUDA build of torch on a GPU machine"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"device: {spec!r} does not exist; this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )
    return device


def resolve_dtype(
    spec: torch.dtype | str | None,
    device: torch.device,
    preferred: torch.dtype | None = None,
) -> torch.dtype:
    """The weights' dtype. Default: float32 on CPU; on CUDA the checkpoint's ``preferred``
    dtype when it has one (GGUF files: float32, what their dequantized tensors are),
    else bfloat16."""
    if spec is None:
        if device.type != "cuda":
            return torch.float32
        return preferred or torch.bfloat16
    if isinstance(spec, str) and spec in DTYPES:
        return DTYPES[spec]
    if isinstance(spec, torch.dtype) and spec in DTYPES.values():
        return spec
    raise ValueError(f"dtype: {spec!r} not supported; use one of {', '.join(DTYPES)}")


def parse_mode(spec: GraphMode | str) -> GraphMode | None:
    """A graph mode, or None for ``"auto"`` (any case); ``ValueError`` lists the names."""
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        return None
    try:
        return GraphMode.parse(spec)
    except ValueError:
        names = ", ".join(m.lower() for m in GraphMode.__members__)
        raise ValueError(f"mode: unknown graph mode {spec!r}; use auto, {names}") from None
