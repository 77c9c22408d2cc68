"""Which attention backend a device gets by default."""

from __future__ import annotations

import torch

from ostinato.engine.kernels.options import KernelOptions, triton_runs_on
from ostinato.engine.model.attention import AttentionBackend, TorchAttention, TritonAttention


def default_backend(device: torch.device, kernels: KernelOptions | None = None) -> AttentionBackend:
    """Triton on CUDA when Triton is installed (launched as ``kernels`` say, with what the
    device lacks off: ``KernelOptions.available_on``), torch_npu's
    fused attention on Ascend, else the torch backend."""
    if device.type == "npu":
        from ostinato.engine.model.ascend_attention import AscendAttention

        return AscendAttention()
    if not triton_runs_on(device):
        return TorchAttention()
    return TritonAttention(pdl=(kernels or KernelOptions()).available_on(device).pdl)
