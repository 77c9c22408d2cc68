"""jit_keys on the CPU, where Triton is installed: the engine's kernels get the same
Triton cache keys in two processes that first computed them in opposite orders (without
``settle`` the sampling kernels that call ``argmax``'s helpers do not). The worker's
side: test_compile_pool.py. On a GPU: test_gpu_kernel_options.py."""

import json
import os
import subprocess
import sys

import pytest

KEYS = r"""
import importlib, json, pkgutil, sys
import ostinato.engine.kernels as kernels
from triton.runtime.jit import JITFunction
names = sorted(m.name for m in pkgutil.iter_modules(kernels.__path__))
order, settle = sys.argv[1], sys.argv[2] == "settle"
modules = [importlib.import_module(f"ostinato.engine.kernels.{n}") for n in names]
functions = {f"{m.__name__}.{k}": v for m in modules for k, v in vars(m).items()
             if isinstance(v, JITFunction) and v.__module__ == m.__name__}
for name in sorted(functions, reverse=order == "reversed"):
    functions[name].cache_key  # each computed cold, in this order
if settle:
    from ostinato.engine.kernels import jit_keys
    jit_keys.settle()
print(json.dumps({k: f.cache_key for k, f in functions.items()}))
"""


def _keys(order: str, settle: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, "-c", KEYS, order, "settle" if settle else "raw"],
        capture_output=True, text=True, env=env, check=True, timeout=300,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_settled_keys_do_not_depend_on_the_order_they_were_first_computed_in():
    pytest.importorskip("triton")
    raw = _keys("sorted", False), _keys("reversed", False)
    differ = sorted(k for k in raw[0] if raw[0][k] != raw[1][k])
    # What settling is for: Triton's own keys moved with the order (the pick kernel's
    # callees read argmax's EMPTY and LOW).
    assert "ostinato.engine.kernels.sampling._pick_kernel" in differ, differ
    settled = _keys("sorted", True), _keys("reversed", True)
    assert len(settled[0]) > 50 and settled[0] == settled[1]
