"""compile_pool on the CPU: the worker protocol and its errors, the worker count, and,
where Triton is installed, the whole path (a ``compile_ahead`` block's warm-up recorded
and not compiled, compiled for sm90 by a real worker process, read back into the kernel
from Triton's disk cache) with a stand-in for the CUDA driver, which this machine lacks.
On a GPU: test_gpu_kernel_options.py."""

import math
import os
import threading
import time

import pytest

from ostinato.engine.kernels import compile_pool
from ostinato.engine.kernels.compile_pool import Request, WorkerError, WorkerPool


def test_the_worker_count_follows_the_cores(monkeypatch):
    monkeypatch.setattr(compile_pool, "quota_cores", lambda: None)
    for cores, workers in ((1, 0), (3, 0), (4, 4), (12, 12), (64, 16)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _, n=cores: set(range(n)))
        assert compile_pool.process_workers() == workers


def test_a_container_s_cpu_quota_caps_the_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(64)))
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir()
    (v1 / "cpu").mkdir(parents=True)
    for text, cores in (("max 100000\n", None), ("250000 100000\n", 3), ("600000 100000", 6)):
        (v2 / "cpu.max").write_text(text)
        assert compile_pool.quota_cores(str(v2)) == cores
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert compile_pool.quota_cores(str(v1)) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("800000\n")
    assert compile_pool.quota_cores(str(v1)) == 8
    assert compile_pool.quota_cores(str(tmp_path / "none")) is None
    for quota, workers in ((None, 16), (3, 0), (8, 8)):
        monkeypatch.setattr(compile_pool, "quota_cores", lambda q=quota: q)
        assert compile_pool.process_workers() == workers


def test_a_pool_without_workers_is_refused_by_name():
    with pytest.raises(ValueError, match="WorkerPool: workers must be >= 1, got 0"):
        WorkerPool(0)


def test_a_kernel_a_worker_cannot_compile_is_named_with_the_worker_s_error():
    pool = WorkerPool(2)
    try:
        bad = Request("ostinato.no_such_module", "_kernel", "{}", ("cuda", 90, 32))
        with pytest.raises(WorkerError, match=r"compiling ostinato.no_such_module._kernel: "):
            pool.compile([bad, bad])
        # The workers live on and answer the next request the same way.
        with pytest.raises(WorkerError, match="no_such_module"):
            pool.compile([bad])
    finally:
        pool.close()


def test_a_worker_that_dies_is_named_and_replaced(monkeypatch):
    pool = WorkerPool(1)
    try:
        bad = Request("ostinato.no_such_module", "_kernel", "{}", ("cuda", 90, 32))
        with pytest.raises(WorkerError):
            pool.compile([bad])
        worker = pool._checkout()
        worker.proc.kill()
        worker.proc.wait()
        with pytest.raises(WorkerError, match=r"the compile worker for .*_kernel exited"):
            worker.compile(bad)
        pool._idle.put(worker)
        with pytest.raises(WorkerError, match="compiling"):  # a fresh worker answers
            pool.compile([bad])
    finally:
        pool.close()


def test_a_worker_that_takes_too_long_is_stopped_and_named(monkeypatch, tmp_path):
    # A worker whose start takes 2 s (a module it imports first sleeps), asked for 0.05.
    (tmp_path / "slow_start.py").write_text("import time\ntime.sleep(2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(compile_pool, "REQUEST_SECONDS", 0.05)
    pool = WorkerPool(1)
    try:
        pool.start(["slow_start"])
        bad = Request("ostinato.no_such_module", "_kernel", "{}", ("cuda", 90, 32))
        with pytest.raises(WorkerError, match=r"_kernel took more than 0 s; its worker was"):
            pool.compile([bad])
        pool._preload = ()  # (the fresh one starts at once)
        monkeypatch.setattr(compile_pool, "REQUEST_SECONDS", 600.0)
        with pytest.raises(WorkerError, match="compiling"):  # a fresh worker answers
            pool.compile([bad])
    finally:
        pool.close()


def test_a_failure_cancels_the_requests_not_yet_started(monkeypatch):
    pool, started = WorkerPool(1), []

    def one(request):
        started.append(request.name)
        raise WorkerError(f"compiling {request.name}: boom")

    monkeypatch.setattr(pool, "_one", one)
    requests = [Request("m", f"k{i}", "{}", ("cuda", 90, 32)) for i in range(20)]
    with pytest.raises(WorkerError, match="k0: boom"):
        pool.compile(requests)
    assert len(started) < 20  # one thread: the rest were cancelled, not run


class StandInDriver:
    """The CUDA driver's face that Triton's launch path reads before a launch: device
    0, an sm90 target. Nothing here runs a kernel."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_target(self):
        return self.target

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


@pytest.fixture
def triton_on_sm90(monkeypatch, tmp_path):
    triton = pytest.importorskip("triton")
    if not compile_pool.supported():
        pytest.skip("needs Triton's jit_cache_hook and preload (3.4 or newer)")
    from triton.runtime.driver import driver

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(driver, "_active", StandInDriver())  # put back as it was after
    return triton


class FakeTensor:
    """What a launch reads of a tensor (dtype, shape, strides, an address); a Triton
    warm-up takes it for one."""

    def __init__(self, dtype, *shape):
        self.dtype, self.shape = dtype, shape

    def stride(self, dim=None):
        strides = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))
        return strides if dim is None else strides[dim]

    def data_ptr(self):
        return 0


def _warm_smem_gemm():
    """A shared-memory (Gluon) GEMM launch's warm-up, as ``small_gemm`` makes it."""
    import torch

    from ostinato.engine.kernels.gemm_launch import CONFIGS, PLAIN
    from ostinato.engine.kernels.smem_gemm import launch_smem

    (config,) = [c for c in CONFIGS if c.smem]
    x, w = FakeTensor(torch.bfloat16, 8, 256), FakeTensor(torch.bfloat16, 128, 256)
    out = FakeTensor(torch.bfloat16, 8, 128)
    launch_smem(
        x, w, None, out, config, epilogue=PLAIN, grid=(128 // config.block_n, 1, 0, 0),
        norm=None, stats=(x, 1, False, False), residual=None, add_out=False,
        rope=((x, x, x, x, x, None, None), (0, 0, 0, 0, 0)), pdl=False,
    )  # fmt: skip


def test_a_block_s_kernels_compile_in_workers_and_load_from_the_disk_cache(
    triton_on_sm90, monkeypatch
):
    import torch
    from triton.runtime.jit import MockTensor

    from ostinato.engine.kernels import launch as launch_module
    from ostinato.engine.kernels.silu_mul import _silu_mul_kernel
    from ostinato.engine.kernels.smem_gemm import _smem_gemm_kernel

    monkeypatch.setattr(compile_pool, "process_workers", lambda: 2)
    monkeypatch.setattr(launch_module, "PROCESS_MIN_KERNELS", 2)
    compiled_here = []
    hook = lambda *, fn, is_manual_warmup, **_: compiled_here.append(is_manual_warmup)  # noqa: E731
    triton_on_sm90.knobs.runtime.jit_cache_hook = hook
    try:
        x, out = MockTensor(torch.bfloat16), MockTensor(torch.bfloat16)
        caches = _silu_mul_kernel.device_caches
        with launch_module.compile_ahead():
            for block in (64, 128):
                for _ in range(2):  # the same specialisation twice: one request
                    launch_module.launch(
                        _silu_mul_kernel, (1, 1), x, out, 64, 128, 64,
                        BLOCK=block, USE_PDL=0, num_warps=4,
                    )  # fmt: skip
            _warm_smem_gemm()  # a Gluon kernel: its own front end
            assert not caches[0][0]  # recorded, not compiled
        kernels = caches[0][0]
        assert len(kernels) == 2  # both read back into the kernel's own cache
        assert len(_smem_gemm_kernel.device_caches[0][0]) == 1
        assert all(k.metadata.target.arch == 90 for k in kernels.values())
        assert compiled_here and all(compiled_here)  # the earlier hook saw every one
        assert triton_on_sm90.knobs.runtime.jit_cache_hook is hook  # and is back
        written = [f for _, _, files in os.walk(os.environ["TRITON_CACHE_DIR"]) for f in files]
        assert sum(f.endswith(".cubin") for f in written) == 3  # by the workers
        # A later block of fewer kernels goes to the workers too, now that they run.
        monkeypatch.setattr(launch_module, "PROCESS_MIN_KERNELS", 100)
        sent = []
        real = WorkerPool.compile
        counted = lambda p, r, first=False: (sent.append(len(r)), real(p, r, first))  # noqa: E731
        monkeypatch.setattr(WorkerPool, "compile", counted)
        with launch_module.compile_ahead():
            launch_module.launch(
                _silu_mul_kernel, (1, 1), x, out, 64, 128, 64, BLOCK=256, USE_PDL=0, num_warps=4
            )
        assert sent == [1] and len(caches[0][0]) == 3
    finally:
        triton_on_sm90.knobs.runtime.jit_cache_hook = None
        _silu_mul_kernel.device_caches.clear()
        _smem_gemm_kernel.device_caches.clear()
        compile_pool.shared_pool().close()


def test_a_kernel_compiled_in_a_worker_is_read_here_after_its_callees_keys(
    triton_on_sm90, monkeypatch
):
    import torch
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import MockTensor

    from ostinato.engine.kernels import argmax, compile_pool, sampling
    from ostinato.engine.kernels import launch as launch_module

    monkeypatch.setattr(compile_pool, "process_workers", lambda: 1)
    monkeypatch.setattr(launch_module, "PROCESS_MIN_KERNELS", 1)
    compiled_here = []
    real = CUDABackend.add_stages  # (a compile's stages: only on a disk-cache miss)

    def add_stages(self, *args, **kwargs):
        compiled_here.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CUDABackend, "add_stages", add_stages)
    for helper in (argmax.unpacked, argmax.packed_max, argmax.key_value, argmax.entry_keys):
        assert helper.cache_key  # first, as by an engine that launched argmax already
    f32, i64, i32 = (MockTensor(d) for d in (torch.float32, torch.int64, torch.int32))
    try:
        with launch_module.compile_ahead():
            launch_module.launch(
                sampling._pick_kernel, (8,), f32, f32, f32, i64, f32, i32, i64, 75,
                CHUNKS=128, num_warps=4,
            )  # fmt: skip
        assert len(sampling._pick_kernel.device_caches[0][0]) == 1  # read back
        assert compiled_here == []  # from the worker's disk cache
    finally:
        sampling._pick_kernel.device_caches.clear()
        compile_pool.shared_pool().close()


def test_a_launch_beside_the_workers_asks_them_first_and_reads_their_cache(
    triton_on_sm90, monkeypatch
):
    """While a block's kernels compile in the workers, a real launch on another thread
    (a step of a background start) that needs a kernel gets it from the workers, ahead
    of their queue, and reads it from the disk cache: nothing compiles in this process."""
    # Over 60 lines: the two launches, the step's thread and the counters they fill are
    # one scene; apart, each part would need the others' patches.
    import torch
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import MockTensor

    from ostinato.engine.kernels import launch as launch_module
    from ostinato.engine.kernels.silu_mul import _silu_mul_kernel

    monkeypatch.setattr(compile_pool, "process_workers", lambda: 2)
    monkeypatch.setattr(launch_module, "PROCESS_MIN_KERNELS", 1)
    compiled_here, asked = [], []
    real_stages, real_ensure, real_compile = (
        CUDABackend.add_stages,
        WorkerPool.ensure,
        WorkerPool.compile,
    )

    def add_stages(*args, **kwargs):  # (a compile's stages: only on a disk-cache miss)
        compiled_here.append(1)
        return real_stages(*args, **kwargs)

    def ensure(pool, request):
        asked.append(request.name)
        return real_ensure(pool, request)

    monkeypatch.setattr(CUDABackend, "add_stages", add_stages)
    monkeypatch.setattr(WorkerPool, "ensure", ensure)
    x, out = MockTensor(torch.bfloat16), MockTensor(torch.bfloat16)
    failures = []

    def step():  # a launch the block did not warm (another BLOCK), run for real
        try:
            launch_module.launch(
                _silu_mul_kernel, (1, 1), x, out, 64, 128, 64, BLOCK=512, USE_PDL=0, num_warps=4
            )
        except Exception as e:  # (no CUDA driver here: the launch itself fails)
            failures.append(e)

    def compile_with_a_step(pool, requests, first=False):
        thread = threading.Thread(target=step)
        thread.start()
        thread.join()
        real_compile(pool, requests, first)

    monkeypatch.setattr(WorkerPool, "compile", compile_with_a_step)
    try:
        with launch_module.compile_ahead():
            launch_module.launch(
                _silu_mul_kernel, (1, 1), x, out, 64, 128, 64, BLOCK=64, USE_PDL=0, num_warps=4
            )
        assert asked == ["_silu_mul_kernel"]  # the step's kernel, asked of the workers
        assert len(_silu_mul_kernel.device_caches[0][0]) == 2  # the block's and the step's
        assert compiled_here == []  # both read from the workers' disk cache
        assert failures  # (the step's launch got as far as running)
        assert triton_on_sm90.knobs.runtime.jit_cache_hook is None  # put back
    finally:
        _silu_mul_kernel.device_caches.clear()
        compile_pool.shared_pool().close()


def _until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _gated_pool(monkeypatch):
    """A one-worker pool whose compiles only record their order, ``k0`` held under way
    until the gate opens (so that the rest queue behind it)."""
    pool, order, gate = WorkerPool(1), [], threading.Event()

    def one(request):
        if request.name == "k0":
            gate.wait(10)
        order.append(request.name)

    monkeypatch.setattr(pool, "_one", one)
    return pool, order, gate


def test_a_launch_asked_of_the_pool_goes_ahead_of_its_queue(monkeypatch):
    pool, order, gate = _gated_pool(monkeypatch)
    requests = [Request("m", f"k{i}", "{}", ("cuda", 90, 32)) for i in range(4)]
    block = threading.Thread(target=pool.compile, args=(requests,))
    block.start()
    _until(lambda: len(pool._queue) == 3)  # k0 under way
    asked = threading.Thread(target=pool.ensure, args=(requests[3],))
    asked.start()
    _until(lambda: pool._queue[0].request.name == "k3")
    gate.set()
    block.join(10)
    asked.join(10)
    assert order == ["k0", "k3", "k1", "k2"]  # each once, the asked one next


def test_a_step_s_block_goes_ahead_of_the_queue_in_its_order(monkeypatch):
    pool, order, gate = _gated_pool(monkeypatch)
    requests = [Request("m", f"k{i}", "{}", ("cuda", 90, 32)) for i in range(3)]
    mine = [Request("m", f"s{i}", "{}", ("cuda", 90, 32)) for i in range(3)] + [requests[2]]
    block = threading.Thread(target=pool.compile, args=(requests,))
    block.start()
    _until(lambda: len(pool._queue) == 2)  # k0 under way
    step = threading.Thread(target=pool.compile, args=(mine, True))
    step.start()
    _until(lambda: pool._queue[0].request.name == "s0")
    gate.set()
    block.join(10)
    step.join(10)
    assert order == ["k0", "s0", "s1", "s2", "k2", "k1"]  # each once, the step's first


def test_a_cold_start_starts_the_workers_before_torch_is_imported(tmp_path, monkeypatch):
    from ostinato.engine.kernels import compile_pool

    started = []

    class Pool:
        def start(self, preload):
            started.append(list(preload))

    monkeypatch.setattr(compile_pool, "shared_pool", lambda: Pool())
    monkeypatch.setattr(compile_pool, "process_workers", lambda: 16)
    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    assert compile_pool.start_for_a_cold_cache(env)  # (missing: a first start)
    assert "ostinato.engine.kernels.rms_norm" in started[0]
    assert "ostinato.engine.kernels.compile_pool" not in started[0]
    (tmp_path / "triton").mkdir()
    assert compile_pool.start_for_a_cold_cache(env) and len(started) == 2  # (empty)
    (tmp_path / "triton" / "some-kernel").mkdir()
    assert not compile_pool.start_for_a_cold_cache(env) and len(started) == 2
    monkeypatch.setattr(compile_pool, "process_workers", lambda: 0)
    assert not compile_pool.start_for_a_cold_cache({"TRITON_HOME": str(tmp_path / "h")})


def test_a_failure_fails_only_its_own_block_s_queue(monkeypatch):
    pool = WorkerPool(1)

    def one(request):
        if request.name == "bad":
            raise WorkerError("compiling m.bad: boom")

    monkeypatch.setattr(pool, "_one", one)
    with pytest.raises(WorkerError, match="bad: boom"):
        pool.compile([Request("m", "bad", "{}", ("cuda", 90, 32))])
    pool.compile([Request("m", "good", "{}", ("cuda", 90, 32))])  # a later block runs
    _until(lambda: pool._threads == 0)  # its feeding thread ends with the queue
    assert not pool._queue and not pool._pending


def test_workers_started_ahead_import_the_kernels_before_their_first_request():
    pool = WorkerPool(2)
    try:
        pool.start(["ostinato.no_such_module", "ostinato.engine.kernels.silu_mul"])
        workers = [pool._idle.get_nowait() for _ in range(2)]  # both started, idle
        for w in workers:
            assert w.proc.args[-2:] == [
                "ostinato.no_such_module",
                "ostinato.engine.kernels.silu_mul",
            ]
            pool._idle.put(w)
        pool.start(["other"])  # running already: nothing more started
        assert pool._idle.qsize() == 2
        workers[0].proc.kill()  # (as one gone idle)
        workers[0].proc.wait()
        pool.start(["other"])  # the one gone replaced, the other kept
        now = [pool._idle.get_nowait() for _ in range(2)]
        (fresh,) = [w for w in now if w is not workers[1]]
        assert workers[1] in now and fresh.proc.args[-1] == "other"
        workers = now
        for w in now:
            pool._idle.put(w)
        # A module that does not import leaves the worker serving (its requests say why).
        bad = Request("ostinato.no_such_module", "_kernel", "{}", ("cuda", 90, 32))
        with pytest.raises(
            WorkerError, match="compiling ostinato.no_such_module._kernel: ModuleNotFoundError"
        ):
            pool.compile([bad])
        assert all(w.alive() for w in workers)
    finally:
        pool.close()


def test_a_worker_s_first_compile_finds_the_key_made_beside_its_imports(monkeypatch):
    # Triton's key (2.6 s of hashing on an H200 host) is made on a thread while the worker
    # imports its kernels; the first request waits for it rather than hashing it again.
    import io
    import json
    import sys
    from dataclasses import asdict

    made = threading.Event()
    order: list[str] = []

    def key() -> bool:
        time.sleep(0.2)
        made.set()
        return True

    def imported(name: str) -> None:
        order.append(f"import {name}, key made: {made.is_set()}")

    def compile_request(request: Request) -> None:
        order.append(f"compile, key made: {made.is_set()}")

    request = Request("m", "k", "{}", ("cuda", 90, 32))
    monkeypatch.setattr(compile_pool.triton_warmup, "warm_key", key)
    monkeypatch.setattr(compile_pool.importlib, "import_module", imported)
    monkeypatch.setattr(compile_pool, "compile_request", compile_request)
    monkeypatch.setattr(compile_pool.signal, "signal", lambda *args: None)
    monkeypatch.setattr(compile_pool.select, "select", lambda r, w, x, t: (r, [], []))
    monkeypatch.setattr(sys, "argv", ["worker", "ostinato.engine.kernels.silu_mul"])
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(asdict(request)) + "\n"))
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    compile_pool.main()
    assert order == [
        "import ostinato.engine.kernels.silu_mul, key made: False",
        "compile, key made: True",
    ]
