"""Triton's once-a-process set-up (``kernels.triton_warmup``) and what an
engine's process starts before torch (``api.early_start``), with stand-ins for Triton's
internals; the GPU test runs the real ones."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

import pytest

from ostinato import early_context
from ostinato.engine.api import early_start
from ostinato.engine.kernels import triton_warmup


def fake_triton(monkeypatch: pytest.MonkeyPatch, root, fail: str | None = None) -> list[str]:
    """Stand-ins for the Triton internals the warm-up calls: a package folder and a cache
    folder under ``root``; returns the calls made (``fail``: the one that raises)."""
    calls: list[str] = []

    def call(name: str) -> str:
        calls.append(name)
        if name == fail:
            raise RuntimeError(f"{name} refused")
        return "the-key"

    package = root / "triton"
    (package / "_C").mkdir(parents=True, exist_ok=True)
    if not (package / "__init__.py").exists():  # (written once: a reinstall changes them)
        (package / "__init__.py").write_text("")
        (package / "_C" / "libtriton.so").write_bytes(b"library")
    triton = types.ModuleType("triton")
    triton.__file__ = str(package / "__init__.py")
    triton.__version__ = "3.6.0"
    triton.knobs = types.SimpleNamespace(cache=types.SimpleNamespace(dir=str(root / "cache")))
    cache = types.ModuleType("triton.runtime.cache")
    cache.triton_key = lambda: call("triton_key")
    driver = types.ModuleType("triton.backends.nvidia.driver")
    driver.CudaUtils = lambda: call("CudaUtils")
    monkeypatch.setitem(sys.modules, "triton", triton)
    for name in ("triton.runtime", "triton.backends", "triton.backends.nvidia"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "triton.runtime.cache", cache)
    monkeypatch.setitem(sys.modules, "triton.backends.nvidia.driver", driver)
    return calls


def test_the_key_and_the_driver_module(tmp_path, monkeypatch):
    calls = fake_triton(monkeypatch, tmp_path)
    assert triton_warmup.warm()
    assert sorted(calls) == ["CudaUtils", "triton_key"]


def test_the_driver_module_does_not_wait_for_the_key(tmp_path, monkeypatch):
    # The module is wanted at the first launch; the key's hash takes seconds longer.
    built = threading.Event()
    calls = fake_triton(monkeypatch, tmp_path)
    sys.modules["triton.backends.nvidia.driver"].CudaUtils = built.set
    sys.modules["triton.runtime.cache"].triton_key = lambda: str(calls.append(built.wait(5)))
    assert triton_warmup.warm()
    assert calls == [True]


@pytest.mark.parametrize("fail", ["triton_key", "CudaUtils"])
def test_a_failure_is_reported_without_raising(tmp_path, monkeypatch, fail):
    calls = fake_triton(monkeypatch, tmp_path, fail)
    assert not triton_warmup.warm()
    assert sorted(calls) == ["CudaUtils", "triton_key"]


def test_a_compile_worker_warms_the_key_alone(tmp_path, monkeypatch):
    calls = fake_triton(monkeypatch, tmp_path)
    assert triton_warmup.warm_key()
    assert calls == ["triton_key"]


def test_a_kept_key_serves_a_later_process_with_the_same_triton(tmp_path, monkeypatch):
    # 2.6-3 s of hashing on the H200 host, at every process's first launch, otherwise.
    calls = fake_triton(monkeypatch, tmp_path)
    assert triton_warmup.warm_key() and calls == ["triton_key"]
    assert (tmp_path / "cache" / triton_warmup.KEY_FILE).is_file()
    calls = fake_triton(monkeypatch, tmp_path)  # (a new process: Triton's own function)
    assert triton_warmup.warm_key() and calls == []
    key = sys.modules["triton.runtime.cache"].triton_key
    assert key() == "the-key" and key.cache_info().currsize == 1


@pytest.mark.parametrize("change", ["library", "version", "corrupt"])
def test_a_kept_key_is_hashed_again_where_triton_differs(tmp_path, monkeypatch, change):
    fake_triton(monkeypatch, tmp_path)
    assert triton_warmup.warm_key()
    if change == "library":  # (a reinstall: another size and time)
        (tmp_path / "triton" / "_C" / "libtriton.so").write_bytes(b"another library")
    if change == "corrupt":
        (tmp_path / "cache" / triton_warmup.KEY_FILE).write_text("{not json")
    calls = fake_triton(monkeypatch, tmp_path)
    if change == "version":
        sys.modules["triton"].__version__ = "3.7.0"
    assert triton_warmup.warm_key() and calls == ["triton_key"]
    calls = fake_triton(monkeypatch, tmp_path)  # (kept again, for the Triton now there)
    if change == "version":
        sys.modules["triton"].__version__ = "3.7.0"
    assert triton_warmup.warm_key() and calls == []


def test_an_unwritable_cache_folder_keeps_nothing_and_still_warms(tmp_path, monkeypatch):
    calls = fake_triton(monkeypatch, tmp_path)
    (tmp_path / "cache").write_text("a file where the folder would be")
    assert triton_warmup.warm_key() and calls == ["triton_key"]


def test_no_triton_does_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # (import triton raises ImportError)
    assert not triton_warmup.warm()
    assert not triton_warmup.warm_key()


@pytest.mark.parametrize(
    "device, world, environ, index",
    [
        ("cpu", 1, {}, None),
        ("cuda:2", 1, {}, 2),
        (None, 1, {}, 0),
        ("cuda", 4, {}, 0),  # (rank 0 in this process, the others started by it)
        (None, 2, {"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 1),  # (a rank torchrun started)
        (None, 2, {"WORLD_SIZE": "2"}, None),  # (its GPU unknown: nothing)
        ("cpu", 2, {"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, None),
    ],
)
def test_an_engine_starts_both_on_its_ranks_gpu(monkeypatch, device, world, environ, index):
    # With one process the compile workers too, where Triton's cache is cold
    # (compile_pool.start_for_a_cold_cache decides): not for several ranks' processes.
    seen: list[object] = []
    monkeypatch.setattr(early_context, "start", lambda index, also: seen.extend([index, also]))
    monkeypatch.setattr(early_start, "torch_has_cuda", lambda: True)
    monkeypatch.setattr(early_start.CompileCache, "point_compilers_here", lambda self: {})
    asked = []
    monkeypatch.setattr(early_start.compile_pool, "start_for_a_cold_cache", asked.append)
    assert early_start.start_early(device, world, environ=environ) == (index is not None)
    assert seen == ([] if index is None else [index, triton_warmup.warm])
    assert asked == ([environ] if index is not None and world == 1 else [])


@pytest.fixture(autouse=True)
def _no_compile_workers(monkeypatch):
    """The tests of ``start_early`` start no real compile workers (a host of 4 cores or
    more would): their own test is test_compile_pool's."""
    monkeypatch.setattr(early_start.compile_pool, "start_for_a_cold_cache", lambda env: False)


@pytest.mark.parametrize("cache_dir", [None, "custom", False, 3])
def test_triton_is_pointed_at_the_engines_cache_before_the_threads_start(
    tmp_path, monkeypatch, cache_dir
):
    # The thread's helper module lands in Triton's cache: the engine's own folder, or the
    # engine's first launch builds it again there (seen on an H200: 1 s of gcc).
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OSTINATO_CACHE_DIR", str(tmp_path / "default"))
    asked = str(tmp_path / cache_dir) if cache_dir == "custom" else cache_dir
    seen: list[object] = []
    monkeypatch.setattr(
        early_context, "start", lambda index, also: seen.append(os.environ.get("TRITON_CACHE_DIR"))
    )
    monkeypatch.setattr(early_start, "torch_has_cuda", lambda: True)
    assert early_start.start_early("cuda", 1, asked, environ={})
    expected = {None: tmp_path / "default", "custom": tmp_path / "custom"}.get(cache_dir)
    assert seen == [None if expected is None else str(expected / "compile" / "triton")]


def test_a_triton_folder_the_user_named_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # (restored after)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setattr(early_context, "start", lambda index, also: None)
    monkeypatch.setattr(early_start, "torch_has_cuda", lambda: True)
    assert early_start.start_early("cuda", 1, str(tmp_path / "engine"), environ={})
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_nothing_starts_where_torch_is_a_cpu_build(monkeypatch):
    seen: list[object] = []
    monkeypatch.setattr(early_context, "start", lambda index, also: seen.append(index))
    monkeypatch.setattr(early_start, "torch_has_cuda", lambda: False)
    assert not early_start.start_early(None) and seen == []


@pytest.mark.parametrize(
    "line, cuda",
    [("cuda: Optional[str] = '13.0'", True), ("cuda = '12.8'", True)]
    + [("cuda: Optional[str] = None", False), ("hip: Optional[str] = '6.4'", False)],
)
def test_a_cuda_build_is_read_from_torchs_version_file(tmp_path, monkeypatch, line, cuda):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "torch" / "version.py").write_text(f"__version__ = '2.11.0'\n{line}\n")
    spec = types.SimpleNamespace(origin=str(tmp_path / "torch" / "__init__.py"))
    monkeypatch.setattr(early_start.importlib.util, "find_spec", lambda name: spec)
    assert early_start.torch_has_cuda() is cuda


GPU_CHECK = """
import sys
from ostinato.engine.kernels import triton_warmup
assert triton_warmup.warm()
from triton.runtime.cache import triton_key
from triton.backends.nvidia.driver import CudaUtils
import torch
from ostinato.engine.kernels.argmax import argmax_rows
x = torch.randn(4, 1000, device="cuda")
ok = bool((argmax_rows(x) == x.argmax(-1)).all())
print(triton_key.cache_info().currsize, hasattr(CudaUtils, "instance"), ok)
"""


@pytest.mark.gpu
def test_a_kernel_launches_after_the_warm_up():
    command = [sys.executable, "-c", GPU_CHECK]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True", "True"], out.stdout + out.stderr
