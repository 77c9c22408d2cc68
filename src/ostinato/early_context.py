"""A GPU's CUDA context, made on a thread while the process is still importing torch.

A command that runs on a GPU spends about a second importing torch and then, at its
first CUDA call, the time the driver takes to create the device's primary context. The
two need not follow one another: the import waits on the interpreter, the context on the
driver, and a ``ctypes`` call into the driver releases the interpreter's lock. So
``start(index)`` creates that context on a daemon thread through the driver API alone
(``libcuda``, no torch), and torch's first CUDA call finds it made: the CUDA runtime,
torch's, uses each device's primary context.

Guarantees: nothing here imports torch, raises or prints. Where the driver is missing
or refuses (no GPU, no such device), nothing is made and torch's own first call reports
what is wrong, as it would have. A context made here is retained for the life of the
process, as torch's own would be. It costs device memory, so only a process that will
use that device calls ``start``; a second call does nothing. ``start`` can run more
such work on a thread beside it (the engine: Triton's set-up).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

_LIBRARY = "libcuda.so.1"
_lock = threading.Lock()
_threads: list[threading.Thread] = []


def device_index(spec: object) -> int | None:
    """The CUDA device an engine's ``device`` names (a string, a ``torch.device``, or
    None: the engine's default, CUDA device 0 where there is one), or None for any other
    device (the CPU)."""
    if spec is None or str(spec) == "cuda":
        return 0
    kind, _, index = str(spec).partition(":")
    if kind != "cuda" or not index.isdigit():
        return None
    return int(index)


def start(index: int | None, also: Callable[[], object] | None = None) -> bool:
    """Starts creating CUDA device ``index``'s primary context on a daemon thread (None:
    nothing), and ``also`` on a second one (more work a first CUDA call would wait on;
    what it raises is dropped); False where a call already started them, or nothing was
    asked."""
    global _threads
    if index is None:
        return False
    with _lock:
        if _threads:
            return False
        work = [("ostinato-cuda-context", _make, (index, _driver))]
        work += [("ostinato-early-work", _quietly, (also,))] if also is not None else []
        _threads = [threading.Thread(target=f, args=a, name=n, daemon=True) for n, f, a in work]
        for thread in _threads:
            thread.start()
    return True


def wait(timeout: float | None = None) -> None:
    """Waits for the threads ``start`` began, if any (the tests')."""
    for thread in list(_threads):
        thread.join(timeout)


def _driver() -> Any:
    """The CUDA driver's library, or None where this machine has none."""
    try:
        return ctypes.CDLL(_LIBRARY)
    except OSError:
        return None


def _quietly(work: Callable[[], object]) -> None:
    try:
        work()
    except Exception:  # (``start``'s promise: nothing here raises)
        pass


def _make(index: int, driver: Any) -> bool:
    """Initialises the driver and retains device ``index``'s primary context through
    ``driver()``'s library; whether it was made (each call stops at the first refusal,
    with the driver's status left for torch to meet and report)."""
    lib = driver()
    if lib is None or lib.cuInit(0) != 0:
        return False
    device = ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(device), index) != 0:
        return False
    context = ctypes.c_void_p()
    return lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
