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
use that device calls ``start``; a second call does nothing.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

_LIBRARY = "libcuda.so.1"
_lock = threading.Lock()
_thread: threading.Thread | None = None


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


def start(index: int | None) -> bool:
    """Starts creating CUDA device ``index``'s primary context on a daemon thread (None:
    nothing); False where a call already started one, or nothing was asked."""
    global _thread
    if index is None:
        return False
    with _lock:
        if _thread is not None:
            return False
        _thread = threading.Thread(
            target=_make, args=(index, _driver), name="ostinato-cuda-context", daemon=True
        )
        _thread.start()
    return True


def wait(timeout: float | None = None) -> None:
    """Waits for the thread ``start`` began, if any (the tests')."""
    thread = _thread
    if thread is not None:
        thread.join(timeout)


def _driver() -> Any:
    """The CUDA driver's library, or None where this machine has none."""
    try:
        return ctypes.CDLL(_LIBRARY)
    except OSError:
        return None


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
