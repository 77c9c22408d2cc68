"""jit_keys on the CPU: the rounds of ``settle`` on stand-ins for jit functions (until no
key changes; a warning where keys never settle); and, where Triton is installed, the
engine's kernels with the same Triton cache keys in two processes that first computed
them in opposite orders (without ``settle`` the sampling kernels that call ``argmax``'s
helpers do not). The worker's side: test_compile_pool.py; on a GPU, compile-ahead's
tests in test_gpu_kernel_options.py run through it."""

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


class FakeJit:
    """What ``_settle`` reads of a ``triton.jit`` function: its lock, its cached hash, and
    a key that takes ``settles_after`` computations to stop changing (never: None)."""

    def __init__(self, settles_after):
        import threading

        self._hash_lock, self.hash, self.computed = threading.RLock(), None, 0
        self.settles_after = settles_after

    @property
    def cache_key(self):
        if self.hash is None:
            self.computed += 1
            last = self.settles_after
            self.hash = str(self.computed if last is None else min(self.computed, last))
        return self.hash


def test_settling_computes_every_key_again_until_none_changes_and_warns_if_never(caplog):
    from ostinato.engine.kernels import jit_keys

    functions = [FakeJit(1), FakeJit(3), FakeJit(2)]
    assert jit_keys._settle(functions) == 3  # the third round's keys are the second's
    assert [f.cache_key for f in functions] == ["1", "3", "2"]
    with caplog.at_level("WARNING"):
        assert jit_keys._settle([FakeJit(None)]) == jit_keys.MAX_ROUNDS
    assert "still changed after" in caplog.text


IN_TWO = r"""
import importlib, json, pkgutil, sys
import ostinato.engine.kernels as kernels
from ostinato.engine.kernels import jit_keys
from triton.runtime.jit import JITFunction
names = sorted(m.name for m in pkgutil.iter_modules(kernels.__path__))
late = {"sampling", "penalize"}  # (they call argmax's helpers, loaded in the first part)
settled = []
settle = jit_keys._settle
jit_keys._settle = lambda fs: settled.append(len(fs)) or settle(fs)
functions = {}
for part in ([n for n in names if n not in late], sorted(late)):
    modules = [importlib.import_module(f"ostinato.engine.kernels.{n}") for n in part]
    for m in modules:
        for k, v in vars(m).items():
            if isinstance(v, JITFunction) and v.__module__ == m.__name__:
                functions[f"{m.__name__}.{k}"] = v
                v.cache_key  # computed cold, before the part's settle
    jit_keys.settle()
own = sum(k.split(".")[-2] in late for k in functions)
print(json.dumps({"keys": {k: f.cache_key for k, f in functions.items()}, "settled": settled,
                  "late_own": own}))
"""


def test_a_later_settle_parses_only_the_new_functions_and_gives_the_same_keys():
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, "-c", IN_TWO], capture_output=True, text=True, env=env, check=True,
        timeout=300,
    )  # fmt: skip
    two = json.loads(out.stdout.strip().splitlines()[-1])
    assert two["keys"] == _keys("sorted", True)  # as one settle of everything gives them
    # The second call's functions: the two late modules' own, not the first part's again.
    assert two["settled"][1] == two["late_own"] > 0, two
    assert two["settled"][0] > 3 * two["late_own"], two
