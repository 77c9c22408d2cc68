"""What Triton does once a process before its first launch, started on threads early.

The first launch of any kernel in a process computes Triton's cache key, a hash of its
own sources and of its compiler library (400 MB; 2.6-2.9 s on the H200 host, 0.4 s on
the development CPU), and loads its driver's helper module (on an empty cache: builds
it with the C compiler, 0.6-0.75 s on the H200 host). Neither needs torch or a GPU, and
both run mostly outside the interpreter's lock (hashing, the compiler's process), so
``warm`` on a thread started before the process imports torch (``api.early_start``) has
them done by the first launch. The two run side by side: the helper module is wanted
first (a first launch on an H200 came 0.7 s after the engine's start, before the key's
hash was done; the launch, the capture thread and this one then each built the module).

Guarantees: ``warm`` and ``warm_key`` never raise. Where Triton is missing or its
internals moved, they do nothing and the first launch does this work as before; a launch
while they still run does the work too (the same result), never waits for it. They use
Triton's internals (``triton.runtime.cache.triton_key``,
``triton.backends.nvidia.driver.CudaUtils``), checked against Triton 3.6.
"""

from __future__ import annotations

import threading


def warm() -> bool:
    """Triton's CUDA driver's helper module loaded (built where its cache has none), on a
    thread of its own, and Triton's cache key computed, on this one; whether both were."""
    loaded: list[bool] = []
    helper = threading.Thread(
        target=lambda: loaded.append(_helper_module()), name="ostinato-triton-helper", daemon=True
    )
    helper.start()
    key = warm_key()
    helper.join()
    return key and loaded == [True]


def warm_key() -> bool:
    """Triton's cache key computed (cached by Triton for the process); whether it was.
    A compile worker needs only this (it builds code, and never launches it)."""
    try:
        from triton.runtime.cache import triton_key

        triton_key()
    except Exception:  # (no Triton, or internals that moved)
        return False
    return True


def _helper_module() -> bool:
    try:
        from triton.backends.nvidia.driver import CudaUtils

        CudaUtils()  # (one instance a process; its module cached on disk)
    except Exception:  # (no Triton, no CUDA toolkit, or internals that moved)
        return False
    return True
