"""The programmatic-dependent-launch prologue shared by ostinato's Triton kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """With ``USE_PDL`` (a kernel launched with ``launch_pdl=True``): wait until the
    previous kernel in the stream has finished and its writes are visible, then let the
    next kernel launch. Call it before the kernel's first memory access: a kernel that
    waits first is safe after any predecessor, PDL-launched or not. Without ``USE_PDL``
    nothing is emitted (the instructions need compute capability 9.0)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
