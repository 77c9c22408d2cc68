"""triton_launch on the CPU, with a stand-in for Triton: ``launch`` runs a kernel, or
inside ``compile_ahead()`` only starts its compilation, under Triton's
AsyncCompileMode when there is one. The real kernels compiled ahead are tested on the GPU
(test_gpu_kernel_options.py)."""

import sys
import types

import pytest

from ostinato.engine.kernels.launch import compile_ahead, compiling_ahead, launch


class Kernel:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("run", grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("compile", grid, args, kwargs))


class AsyncMode:
    entered = []

    def __init__(self, executor):
        self.executor = executor

    def __enter__(self):
        AsyncMode.entered.append(self.executor)

    def __exit__(self, *exc):
        AsyncMode.entered.append("exit")


@pytest.fixture
def fake_triton(monkeypatch):
    module = types.ModuleType("triton")
    module.AsyncCompileMode = AsyncMode
    AsyncMode.entered.clear()
    monkeypatch.setitem(sys.modules, "triton", module)
    return module


def test_launch_runs_the_kernel_outside_compile_ahead():
    k = Kernel()
    launch(k, (3, 1), "x", 2, BLOCK=64, num_warps=4)
    assert k.calls == [("run", (3, 1), ("x", 2), {"BLOCK": 64, "num_warps": 4})]
    assert not compiling_ahead()


def test_inside_compile_ahead_launches_only_compile_under_async_compile_mode(fake_triton):
    k = Kernel()
    with compile_ahead(workers=2):
        assert compiling_ahead()
        launch(k, (5,), "y", BLOCK=32)
        assert len(AsyncMode.entered) == 1  # the mode is active with a thread pool
    assert AsyncMode.entered[-1] == "exit"
    assert k.calls == [("compile", (5,), ("y",), {"BLOCK": 32})]
    assert not compiling_ahead()
    launch(k, (5,), "y", BLOCK=32)  # afterwards it runs again
    assert k.calls[-1][0] == "run"


def test_without_async_compile_mode_launches_still_only_compile(fake_triton):
    del fake_triton.AsyncCompileMode
    k = Kernel()
    with compile_ahead():
        launch(k, (1,), BLOCK=16)
    assert k.calls == [("compile", (1,), (), {"BLOCK": 16})]


def test_compile_ahead_is_not_reentrant_and_resets_after_an_error(fake_triton):
    with pytest.raises(RuntimeError, match="already inside compile_ahead"):
        with compile_ahead(), compile_ahead():
            pass
    assert not compiling_ahead()
    with pytest.raises(ValueError, match="boom"):
        with compile_ahead():
            raise ValueError("boom")
    assert not compiling_ahead()


def test_a_pool_without_threads_is_refused_by_name_before_anything_starts(fake_triton):
    with pytest.raises(ValueError, match="compile_ahead: workers must be >= 1, got 0"):
        with compile_ahead(workers=0):
            pass
    assert not compiling_ahead() and AsyncMode.entered == []


def test_a_launch_beside_the_steps_waits_while_a_step_holds_the_turn(monkeypatch):
    # A background thread's warm-ups, recordings and timings launch through ``launch``:
    # while a step holds the turn, they wait (ostinato.steps_first), so the step's launch
    # has the interpreter to itself.
    import threading
    import time

    from ostinato import background
    from ostinato.background import Turn
    from ostinato.steps_first import beside

    monkeypatch.setattr(background, "STEP_WAIT_S", 10.0)  # (past the step's hold)
    turn, holding, kernel, released = Turn(), threading.Event(), Kernel(), []

    def step():
        with turn:
            holding.set()
            time.sleep(0.3)
            released.append(time.monotonic())

    threading.Thread(target=step, daemon=True).start()
    assert holding.wait(10)
    launch(kernel, (1,))  # (the step's own thread, or any not beside: at once)
    assert not released and len(kernel.calls) == 1
    with beside(turn):
        launch(kernel, (2,))
    assert released and time.monotonic() >= released[0] and len(kernel.calls) == 2


def test_a_step_s_kernels_go_ahead_of_started_workers_and_never_wait_for_their_start(
    fake_triton, monkeypatch
):
    # A step's own few kernels (``KernelPlan.compile_first``): to the front of the worker
    # pool's queue where it was started (early, by a cold start: compile_pool); where it
    # was not, on threads, rather than starting the workers (3-4 s) for them.
    from ostinato.engine.kernels import compile_pool
    from ostinato.engine.kernels import launch as launch_module

    compiled = []

    class Collector:
        requests = ["a request"]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def end_block(self):
            pass

        def compile_in(self, pool, first=False):
            compiled.append(first)

        def load(self):
            pass

    monkeypatch.setattr(launch_module, "_collects", lambda: True)
    monkeypatch.setattr(compile_pool, "Collector", Collector)
    monkeypatch.setattr(compile_pool, "shared_pool", lambda: "pool")
    monkeypatch.setattr(compile_pool, "pool_started", lambda: False)
    k = Kernel()
    with compile_ahead(first=True):
        launch(k, (2,), BLOCK=8)
    assert k.calls == [("compile", (2,), (), {"BLOCK": 8})]
    assert compiled == [] and AsyncMode.entered[-1] == "exit"  # on threads
    monkeypatch.setattr(compile_pool, "pool_started", lambda: True)
    with compile_ahead(first=True):
        pass
    with compile_ahead():  # (a start's block: at the queue's end)
        pass
    assert compiled == [True, False]


def test_kernels_compiled_on_threads_have_their_launchers_built_there_too(fake_triton, monkeypatch):
    # Each kernel's first launch would build its C launcher (0.3-0.8 s on an H200 host),
    # one after another on the launching thread: built beside each other instead.
    import threading
    import types

    from ostinato.engine.kernels import compile_pool

    compiled = [types.SimpleNamespace(metadata=types.SimpleNamespace(target=("cuda", 90, 32)))]

    class Mode:
        def __init__(self, executor):
            self.future_kernels = {}

        def __enter__(self):
            self.future_kernels = {"k": types.SimpleNamespace(kernel=compiled[0])}
            return self

        def __exit__(self, *exc):
            pass

    built = []
    fake_triton.AsyncCompileMode = Mode
    monkeypatch.setattr(
        compile_pool,
        "build_launcher",
        lambda kernel, target: built.append((kernel, target, threading.current_thread().name)),
    )
    with compile_ahead(workers=2):
        pass
    assert [(k, t) for k, t, _ in built] == [(compiled[0], ("cuda", 90, 32))]
    assert built[0][2].startswith("ostinato-triton")  # on the pool's threads
