"""How the engine's own CUDA kernels are launched inside a step: one small dataclass the
model is built with and every module that launches a kernel reads (its norms, its MLPs,
the attention backend made by ``default_backend``); the runner follows the model's for
the compiled pieces, the small-GEMM plans and compile-ahead."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def triton_runs_on(device: torch.device) -> bool:
    """Whether the engine's Triton kernels can run on ``device``: a CUDA device, with
    Triton installed."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class KernelOptions:
    """Launch choices for the engine's kernels.

    ``fused_layers`` (on by default): each decoder layer's two norm-then-projection pairs
    are the ops of ``model.fused_ops``; on CUDA at most ``small_gemm.MAX_ROWS`` (16) rows
    (decode) make each one kernel, the QKV one also writing the keys (rotated) and values
    to the cache, and every projection of such a step runs the Triton GEMM: a layer is
    five kernels and attention's split-KV merge. Larger batches, and other devices, run
    the unfused kernels, the same arithmetic.

    ``pdl`` (on by default where the device has it): programmatic dependent launch
    (Hopper and newer). ostinato's Triton kernels (norms, K/V write, attention, small
    GEMMs) of steps of at most 16 rows (``launch.pdl_for``) are launched so that each
    may start while its predecessor drains; each waits (``griddepcontrol.wait``) before
    touching memory, so results are unchanged. Turned off by ``resolved`` on devices
    without it.

    ``small_gemm``: projections whose row count is at most ``small_gemm.MAX_ROWS`` (16) use a
    Triton GEMM (the down projection with SiLU·mul fused into its load) wherever a
    start-up measurement on this device found it faster than cuBLAS for that shape and
    row count; elsewhere cuBLAS, so never slower than it as measured.

    ``compile_ahead``: at start-up, before the first forward pass, one eager pass per
    kernel layout (a prefill at the largest size, a one-token decode) queues the
    compilation of every ostinato Triton kernel it would launch on a thread pool
    (``triton_launch.compile_ahead``), running none; they compile together and beside
    Dynamo's trace and Inductor, instead of one by one at their first launches. Outputs
    are unchanged; it only moves compile time.

    ``persistent_layers`` (opt-in): steps of at most 16 rows run every decoder layer in
    one persistent kernel (``model.persistent``: one program per SM, a grid barrier
    between a layer's five stages) instead of six kernels per layer; larger steps run
    the layers as before. CUDA, 16-bit weights, one GPU and the Triton attention
    backend only (the runner refuses it otherwise, saying why).
    """

    pdl: bool = True
    small_gemm: bool = False
    compile_ahead: bool = False
    fused_layers: bool = True
    persistent_layers: bool = False

    def __post_init__(self) -> None:
        for name in ("pdl", "small_gemm", "compile_ahead", "fused_layers", "persistent_layers"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"KernelOptions.{name}: expected True or False, got {getattr(self, name)!r}"
                )

    def resolved(self, device: torch.device) -> KernelOptions:
        """These options with what ``device`` cannot do turned off (PDL needs compute
        capability 9.0; the launch options need CUDA and Triton). ``fused_layers`` stays:
        its ops run everywhere, unfused where the kernel cannot."""
        if not triton_runs_on(device):
            off = dict(small_gemm=False, compile_ahead=False, persistent_layers=False)
            return replace(self, pdl=False, **off)
        major, _ = torch.cuda.get_device_capability(device)
        return replace(self, pdl=self.pdl and major >= 9)
