"""The CUDA context made while torch imports (``ostinato.early_context``), with a test
double of the driver; the real driver's case is the GPU test beside it."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading

import pytest

from ostinato import early_context


class FakeDriver:
    """The three driver calls ``early_context`` makes, each answering ``status[name]``
    (0: success), recorded in order."""

    def __init__(self, **status: int) -> None:
        self.status = status
        self.calls: list[tuple[str, object]] = []

    def cuInit(self, flags: int) -> int:  # noqa: N802 (the driver's names)
        self.calls.append(("cuInit", flags))
        return self.status.get("cuInit", 0)

    def cuDeviceGet(self, device: object, index: int) -> int:  # noqa: N802
        self.calls.append(("cuDeviceGet", index))
        ctypes.cast(device, ctypes.POINTER(ctypes.c_int)).contents.value = 40 + index
        return self.status.get("cuDeviceGet", 0)

    def cuDevicePrimaryCtxRetain(self, context: object, device: ctypes.c_int) -> int:  # noqa: N802
        self.calls.append(("cuDevicePrimaryCtxRetain", device.value))
        return self.status.get("cuDevicePrimaryCtxRetain", 0)


@pytest.mark.parametrize(
    "spec, index",
    [(None, 0), ("cuda", 0), ("cuda:0", 0), ("cuda:3", 3), ("cpu", None), ("cuda:x", None)]
    + [("npu:0", None), ("", None)],
)
def test_the_device_index_an_engine_device_names(spec, index):
    assert early_context.device_index(spec) == index


def test_a_device_object_names_its_index_as_its_text_does():
    import torch

    assert early_context.device_index(torch.device("cuda", 2)) == 2
    assert early_context.device_index(torch.device("cpu")) is None


def test_the_context_of_the_device_asked_for_is_retained():
    driver = FakeDriver()
    assert early_context._make(2, lambda: driver)
    assert driver.calls == [("cuInit", 0), ("cuDeviceGet", 2), ("cuDevicePrimaryCtxRetain", 42)]


@pytest.mark.parametrize("refused", ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"])
def test_a_refusal_stops_there_without_raising(refused):
    driver = FakeDriver(**{refused: 100})  # (CUDA_ERROR_NO_DEVICE)
    assert not early_context._make(0, lambda: driver)
    order = ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]
    assert [name for name, _ in driver.calls] == order[: order.index(refused) + 1]


def test_no_driver_makes_nothing():
    assert not early_context._make(0, lambda: None)


def test_start_begins_once_and_never_for_the_cpu(monkeypatch):
    made: list[int] = []
    monkeypatch.setattr(early_context, "_threads", [])
    monkeypatch.setattr(early_context, "_make", lambda index, driver: made.append(index))
    assert not early_context.start(None)
    assert early_context.start(1)
    assert not early_context.start(0)  # (one context a process)
    early_context.wait(5)
    assert made == [1]


def test_more_work_runs_beside_the_context_and_its_errors_are_dropped(monkeypatch):
    seen: list[str] = []

    def also() -> None:
        seen.append(threading.current_thread().name)
        raise RuntimeError("dropped")

    monkeypatch.setattr(early_context, "_threads", [])
    monkeypatch.setattr(early_context, "_make", lambda index, driver: seen.append("context"))
    assert early_context.start(0, also=also)
    early_context.wait(5)
    assert sorted(seen) == ["context", "ostinato-early-work"]


def test_it_imports_no_torch_and_is_silent_without_a_gpu():
    # (On a machine without the driver, as CI's: the thread finds none and ends.)
    code = (
        "import sys\n"
        "from ostinato import early_context\n"
        "early_context.start(0)\n"
        "early_context.wait(30)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "False\n"
    if not _has_driver():
        assert out.stderr == ""


def _has_driver() -> bool:
    try:
        ctypes.CDLL(early_context._LIBRARY)
    except OSError:
        return False
    return True


GPU_CHECK = """
import ctypes, sys
from ostinato import early_context
index = int(sys.argv[1])
assert early_context.start(index)
import torch
early_context.wait(60)
x = torch.arange(1000, device="cuda").sum()   # torch's first CUDA work, on its device
lib = ctypes.CDLL("libcuda.so.1")
current, primary, device = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int()
assert lib.cuCtxGetCurrent(ctypes.byref(current)) == 0
assert lib.cuDeviceGet(ctypes.byref(device), index) == 0
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), device) == 0
print(int(x), torch.cuda.current_device(), current.value == primary.value)
"""


@pytest.mark.gpu
def test_torch_runs_in_the_context_made_before_its_import():
    # torch's first CUDA call finds the primary context the thread made and works in it
    # (the thread retained the very context torch made current, not one of its own).
    out = subprocess.run(
        [sys.executable, "-c", GPU_CHECK, "0"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["499500", "0", "True"], out.stdout + out.stderr
