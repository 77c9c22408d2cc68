"""Triton cache keys of the engine's kernels that do not depend on the order they were
first computed in, so a kernel compiled in one process (a compile worker, an earlier
start) is a disk-cache hit in another.

A ``triton.jit`` function's cache key (``JITFunction.cache_key``, Triton 3.6) hashes
the ``tl.constexpr`` globals it uses, its callees' included; but a callee's globals are
merged into its caller's before the callee's own key is computed, so they are missing
from the caller's key where the callee's key had not been computed yet in that process.
The sampling kernels calling ``argmax``'s helpers (which read ``EMPTY`` and ``LOW``) got
one key in a compile worker, which computes them cold, and another in the engine, which
had launched ``argmax`` first: each was compiled again on the capture thread, holding
the GIL for 12-160 ms each, beside the steps, on an H200.

``settle`` computes every key of the newly loaded ``ostinato`` kernel modules again until
no key changes: each then carries every global of its callees, whatever came first.
Functions settled by an earlier call are left as they are: their callees were loaded
with them (a module imports what its kernels call), so their keys are already whole;
a later settle (the sampling kernels', as the capture ends, on the thread that captures
beside the steps) parses only the new functions: 19 instead of 72, 24-39 ms instead of
63-91 on this project's CPU machine.
Guarantees: after ``settle()``, a function's key is the same in every process that
settled the modules defining it and its callees, in one call or in several (keys that
never settle are a warning: misses, not wrong kernels); with a Triton without these
attributes, nothing is done.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

MAX_ROUNDS = 8  # rounds until no key changes: one more than the deepest chain of callees

_settled: set[str] = set()  # the modules whose functions were settled
_settled_functions: set[int] = set()  # ids of those functions (module-level: never freed)
_lock = threading.Lock()


def settle(prefix: str = "ostinato.") -> int:
    """Settles the keys of the ``triton.jit`` functions named in the modules named
    ``prefix``... loaded since the last call (each module's own and what it imports),
    but for those an earlier call settled; returns the rounds it took (0: nothing new)."""
    with _lock:
        modules = {n: m for n, m in list(sys.modules.items()) if n.startswith(prefix) and m}
        new = [m for n, m in modules.items() if n not in _settled]
        functions = [f for f in _jit_functions(new) if id(f) not in _settled_functions]
        rounds = _settle(functions) if functions else 0
        _settled.update(modules)
        _settled_functions.update(id(f) for f in functions)
        return rounds


def _jit_functions(modules: list[ModuleType]) -> list[Any]:
    """The ``triton.jit`` functions ``modules`` name, once each."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    found: dict[int, Any] = {}
    for module in modules:
        for value in list(vars(module).values()):
            if isinstance(value, JITFunction) and hasattr(value, "_hash_lock"):
                found.setdefault(id(value), value)
    return list(found.values())


def _settle(functions: list[Any]) -> int:
    """Computes the keys of ``functions`` again, round after round, until a round changes
    none (each round starts from every callee's globals as the last round found them);
    returns the rounds. Keys still changing after ``MAX_ROUNDS`` are a warning, not an
    error: they cost disk-cache misses (compiles here), never a wrong kernel."""
    before = [f.cache_key for f in functions]
    for rounds in range(1, MAX_ROUNDS + 1):
        for f in functions:
            with f._hash_lock:
                f.hash = None
        after = [f.cache_key for f in functions]
        if after == before:
            return rounds
        before = after
    logger.warning(
        "ostinato: Triton's kernel cache keys still changed after %d rounds (a chain of jit "
        "functions deeper than that, or a key that depends on something else): kernels "
        "compiled in the workers may be compiled again here",
        MAX_ROUNDS,
    )
    return MAX_ROUNDS
