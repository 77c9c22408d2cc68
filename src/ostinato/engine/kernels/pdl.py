"""The programmatic-dependent-launch prologue shared by ostinato's Triton kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """With ``USE_PDL`` (``launch.pdl_arg`` of a kernel launched with ``launch_pdl=True``):
    wait until the previous kernel in the stream has finished and its writes are visible,
    and let the next kernel launch, after the wait (1) or before it (2). Call it before the
    kernel's first memory access that depends on an earlier kernel: a kernel that waits
    first is safe after any predecessor, PDL-launched or not. Without ``USE_PDL`` nothing
    is emitted (the instructions need compute capability 9.0)."""
    if USE_PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
