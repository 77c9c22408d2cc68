"""What Triton does once a process before its first launch, started on a thread early.

The first launch of any kernel in a process computes Triton's cache key, a hash of its
own sources and of its compiler library (400 MB; 0.4 s on the development CPU), and
loads its driver's helper module (on an empty cache: builds it with the C compiler,
about 1.3 s on the H200 host). Neither needs torch or a GPU, and both run outside the
interpreter's lock (hashing, the compiler's process), so ``warm`` on a thread started
before the process imports torch (``api.early_start``) has them done by the first
launch.

Guarantees: ``warm`` never raises. Where Triton is missing or its internals moved, it
does nothing and the first launch does this work as before; a launch while it still
runs on its thread does the work too (the same result), never waits for it. It uses
Triton's internals (``triton.runtime.cache.triton_key``,
``triton.backends.nvidia.driver.CudaUtils``), checked against Triton 3.6.
"""

from __future__ import annotations


def warm() -> bool:
    """Triton's cache key computed and its CUDA driver's helper module loaded (built
    where its cache has none); whether both were done."""
    try:
        from triton.runtime.cache import triton_key

        triton_key()  # (cached by Triton for the process)
        from triton.backends.nvidia.driver import CudaUtils

        CudaUtils()  # (one instance a process; its module cached on disk)
    except Exception:  # (no Triton, no CUDA toolkit, or internals that moved)
        return False
    return True
