"""What Triton does once a process before its first launch, started on a thread early.

The first launch of any kernel in a process computes Triton's cache key, a hash of its
own sources and of its compiler library (400 MB; 0.4 s on the development CPU), and
loads its driver's helper module (on an empty cache: builds it with the C compiler,
about 1.3 s on the H200 host). Neither needs torch or a GPU, and both run outside the
interpreter's lock (hashing, the compiler's process), so a thread started before the
process imports torch has them done by the first launch.

Guarantees: ``start`` never raises and starts at most one thread. Where Triton is
missing or its internals moved, the thread does nothing and the first launch does this
work as before; a launch while the thread still runs does it too (the same result),
never waits for the thread. Uses Triton's internals (``triton.runtime.cache.triton_key``,
``triton.backends.nvidia.driver.CudaUtils``), checked against Triton 3.6.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_thread: threading.Thread | None = None


def start() -> bool:
    """Starts the thread (False where one was started already)."""
    global _thread
    with _lock:
        if _thread is not None:
            return False
        _thread = threading.Thread(target=warm, name="ostinato-triton-warmup", daemon=True)
        _thread.start()
    return True


def wait(timeout: float | None = None) -> None:
    """Waits for the thread ``start`` began, if any (the tests')."""
    thread = _thread
    if thread is not None:
        thread.join(timeout)


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
