"""What Triton does once a process before its first launch, started on threads early.

The first launch of any kernel in a process computes Triton's cache key, a hash of its
own sources and of its compiler library (415 MB: 2.6-3 s on the H200 host, 0.4 s on the
development CPU), and loads its driver's helper module (on an empty cache: builds it
with the C compiler, 0.6-0.75 s on the H200 host). Neither needs torch or a GPU, and
both run mostly outside the interpreter's lock (hashing, the compiler's process), so
``warm`` on a thread started before the process imports torch (``api.early_start``) has
them done by the first launch. The two run side by side: the helper module is wanted
first (a first launch on an H200 came 0.7 s after the engine's start, before the key's
hash was done; the launch, the capture thread and this one then each built the module).

The key is also kept beside Triton's cache (``KEY_FILE``) under the identity of every
file of the Triton package (path, size, modification time) and its version: a later
process whose Triton reads the same takes the key from there instead of hashing again
(an engine that got ready before the hash was done launched its first kernels only once
it had hashed the library itself).

Guarantees: ``warm`` and ``warm_key`` never raise. Where Triton is missing or its
internals moved, they do nothing and the first launch does this work as before; a launch
while they still run does the work too (the same result), never waits for it. A kept key
is used only where every file's identity matches; otherwise the key is hashed as Triton
does and kept again. They use Triton's internals (``triton.runtime.cache.triton_key``,
which a kept key replaces for the process, ``triton.knobs.cache.dir``,
``triton.backends.nvidia.driver.CudaUtils``), checked against Triton 3.6.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from ostinato.cache_root import replace_file

KEY_FILE = "ostinato-triton-key.json"


def warm() -> bool:
    """Triton's CUDA driver's helper module loaded (built where its cache has none), on a
    thread of its own, and Triton's cache key made, on this one; whether both were."""
    try:  # (here first: two threads importing one package at once may see it half made)
        import triton.backends.nvidia.driver  # noqa: F401
        import triton.runtime.cache  # noqa: F401
    except Exception:  # (no Triton, or internals that moved)
        return False
    loaded: list[bool] = []
    helper = threading.Thread(
        target=lambda: loaded.append(_helper_module()), name="ostinato-triton-helper", daemon=True
    )
    helper.start()
    key = warm_key()
    helper.join()
    return key and loaded == [True]


def warm_key() -> bool:
    """Triton's cache key made for this process: read where it was kept for this very
    Triton, else hashed as Triton does and kept; whether it was. A compile worker needs
    only this (it builds code, and never launches it)."""
    try:
        import triton
        from triton.runtime import cache

        folder = Path(triton.knobs.cache.dir)
        identity = triton_identity(Path(triton.__file__).parent, triton.__version__)
        kept = _read_kept(folder / KEY_FILE, identity)
        if kept is not None:
            cache.triton_key = _known(kept)
        else:
            text = json.dumps({"identity": identity, "key": cache.triton_key()})
            with contextlib.suppress(OSError):  # (not kept: a later process hashes again)
                replace_file(folder / KEY_FILE, text)
    except Exception:  # (no Triton, or internals that moved)
        return False
    return True


def triton_identity(package: Path, version: str) -> str:
    """A digest of the Triton package's version and of every file's path, size and
    modification time (what Triton's key hashes lies among them)."""
    digest = hashlib.sha256(f"{package.resolve()}\n{version}\n".encode())
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            st = os.stat(os.path.join(root, name))
            rel = os.path.relpath(os.path.join(root, name), package)
            digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _read_kept(path: Path, identity: str) -> str | None:
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("identity") != identity:
        return None
    key = kept.get("key")
    return key if isinstance(key, str) and key else None


def _known(key: str) -> Any:
    """Stands in for ``triton_key``: the same value, cached as Triton's is."""

    @functools.lru_cache
    def triton_key() -> str:
        return key

    triton_key()
    return triton_key


def _helper_module() -> bool:
    try:
        from triton.backends.nvidia.driver import CudaUtils

        CudaUtils()  # (one instance a process; its module cached on disk)
    except Exception:  # (no Triton, no CUDA toolkit, or internals that moved)
        return False
    return True
