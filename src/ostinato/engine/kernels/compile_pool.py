"""Compiling the engine's Triton kernels in worker processes, for ``compile_ahead``.

Triton's compiler front end holds the GIL, so compile threads take as long as one
(measured on an H200's 16 cores: 166 kernels in 15.9 s on 8 threads, 16.0 s on 16).
Here the launches of a ``compile_ahead()`` block are collected instead
(``Collector``, Triton's ``jit_cache_hook``: it records each warm-up's specialisation of
an ostinato kernel and skips its compile), compiled by worker processes
(``WorkerPool``: ``python -m ostinato.engine.kernels.compile_pool``, one JSON request a
line, each compile written to Triton's disk cache, with its C launcher built), and then
loaded in this process from that cache (``Collector.load``, Triton's ``preload``).

Guarantees: a kernel loaded here is the one Triton would have compiled at its launch
(the same specialisation, options and target, read back by Triton's own cache key,
which ``jit_keys.settle`` makes the same in the workers as here);
a failed compile raises, naming the kernel and the worker's error; a worker never
touches a GPU (it builds for the parent's target, with no device visible) and exits
on its own after ``IDLE_SECONDS`` without work; one that takes ``REQUEST_SECONDS``
over a kernel is stopped and named.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any

from ostinato.engine.kernels import jit_keys

IDLE_SECONDS = 120.0  # a worker's life without requests (start-up compiles come in bursts)
# Past this a request is taken for hung (the slowest kernel of ours compiles in seconds,
# a worker's first request also pays torch's import).
REQUEST_SECONDS = 600.0
MAX_WORKERS = 16  # as many as an H200 host's cores for one GPU
MIN_CORES = 4  # below, the workers' own start-up (torch's import) outweighs the gain


@dataclass(frozen=True)
class Request:
    """One kernel specialisation to compile: the ``triton.jit`` function ``name`` of
    ``module``, Triton's serialised specialisation ``spec``, for ``target`` (backend,
    architecture, warp size)."""

    module: str
    name: str
    spec: str
    target: tuple[str, int | str, int]


def process_workers() -> int:
    """Worker processes for a start on this host: one per core this process may use (its
    CPU affinity, and a container's CPU quota) up to ``MAX_WORKERS``, none under
    ``MIN_CORES`` (then ``compile_ahead`` keeps its threads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = min(cores or 1, quota_cores() or MAX_WORKERS)
    return 0 if cores < MIN_CORES else min(MAX_WORKERS, cores)


CGROUP = "/sys/fs/cgroup"


def quota_cores(root: str = CGROUP) -> int | None:
    """The cores a cgroup CPU quota allows (rounded up), or None without one: cgroup v2's
    ``cpu.max``, else v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        try:
            with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    try:
        return max(1, -(-int(quota) // int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def supported() -> bool:
    """Whether this Triton has what the collector needs (its ``jit_cache_hook`` and
    ``preload``, Triton 3.4 and newer)."""
    try:
        import triton
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    knobs = getattr(triton, "knobs", None)
    return hasattr(getattr(knobs, "runtime", None), "jit_cache_hook") and hasattr(
        JITFunction, "preload"
    )


_collecting: ContextVar[Collector | None] = ContextVar("ostinato_collector", default=None)


class Collector:
    """Inside ``with Collector()``, records every warm-up of an ostinato kernel on this
    thread (``launch`` inside ``compile_ahead``) as a ``Request`` and skips its compile;
    other threads, other kernels and real launches compile as usual. ``load``, after the
    block, reads each recorded kernel from Triton's disk cache into its function."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self._functions: dict[tuple[str, str], Any] = {}  # (module, name) -> JITFunction
        self._seen: set[tuple[int, object, str]] = set()
        self._previous: Any = None

    def __enter__(self) -> Collector:
        import triton

        self._previous = triton.knobs.runtime.jit_cache_hook
        triton.knobs.runtime.jit_cache_hook = self._hook
        self._token = _collecting.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        import triton

        _collecting.reset(self._token)
        triton.knobs.runtime.jit_cache_hook = self._previous

    def _hook(self, *, fn: Any, compile: dict, is_manual_warmup: bool, **kwargs: Any) -> bool:
        # A hook someone set before (a test's, a profiler's) still sees every compile.
        previous = self._previous
        if previous is not None and previous(
            fn=fn, compile=compile, is_manual_warmup=is_manual_warmup, **kwargs
        ):
            return True
        jit = fn.jit_function
        module = getattr(jit.fn, "__module__", "")
        if _collecting.get() is not self or not is_manual_warmup:
            return False
        if not module.startswith("ostinato."):
            return False
        seen = (id(jit), compile["device"], kwargs["key"])
        if seen not in self._seen:
            self._seen.add(seen)
            target = jit.device_caches[compile["device"]][2]
            name = jit.fn.__qualname__
            self._functions[(module, name)] = jit
            self.requests.append(
                Request(module, name, compile["specialization_data"], _target(target))
            )
        return True  # compiled elsewhere; ``load`` brings it here

    def load(self) -> None:
        """Reads every recorded kernel into its function (a disk-cache hit after the
        workers, their keys and ours settled alike: ``jit_keys``; a compile here where
        there was none). Call after the block."""
        jit_keys.settle()
        for r in self.requests:
            self._functions[(r.module, r.name)].preload(r.spec)


def _target(target: Any) -> tuple[str, int | str, int]:
    return (target.backend, target.arch, target.warp_size)


class WorkerError(RuntimeError):
    """A worker could not compile a kernel (its message is the worker's error)."""


class _Worker:
    """One ``python -m ostinato.engine.kernels.compile_pool`` process."""

    def __init__(self) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # it builds code, never runs it
        # The parent's import path, so the worker imports the same ostinato and kernels.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # A file, not a pipe: a worker's warnings never fill a buffer nobody reads.
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ostinato.engine.kernels.compile_pool"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            text=True,
            bufsize=1,
        )

    def compile(self, request: Request) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(asdict(request)) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the empty reply below says so
        # One reply line in flight at most, so nothing waits in stdout's buffer here.
        ready, _, _ = select.select([self.proc.stdout], [], [], REQUEST_SECONDS)
        if not ready:
            self.proc.kill()
            self.proc.wait()  # dead before it goes back to the pool, which replaces it
            raise WorkerError(
                f"compiling {request.module}.{request.name} took more than "
                f"{REQUEST_SECONDS:.0f} s; its worker was stopped"
            )
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.stderr.seek(0)
            err = self.stderr.read()[-2000:]
            raise WorkerError(
                f"the compile worker for {request.module}.{request.name} exited "
                f"(code {self.proc.returncode}): {err}"
            )
        reply = json.loads(line)
        if reply.get("error"):
            raise WorkerError(f"compiling {request.module}.{request.name}: {reply['error']}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive() and self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()
        self.stderr.close()


class WorkerPool:
    """``workers`` compile processes, started at first use and kept while they live
    (each exits after ``IDLE_SECONDS`` without requests; a dead one is replaced)."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"WorkerPool: workers must be >= 1, got {workers}")
        self.workers = workers
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()

    def compile(self, requests: Iterable[Request]) -> None:
        """Compiles every request into Triton's disk cache, ``workers`` at a time;
        raises the first failure (``WorkerError``, or an interrupt) once the compiles
        under way have ended, the requests not yet started cancelled."""
        requests = list(requests)
        threads = ThreadPoolExecutor(min(self.workers, len(requests) or 1))
        try:
            for future in [threads.submit(self._one, r) for r in requests]:
                future.result()
        finally:
            threads.shutdown(wait=True, cancel_futures=True)

    def _one(self, request: Request) -> None:
        worker = self._checkout()
        try:
            worker.compile(request)
        finally:
            self._idle.put(worker)

    def _checkout(self) -> _Worker:
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return _Worker()
            if worker.alive():
                return worker
            worker.close()  # gone idle: a fresh one replaces it

    def close(self) -> None:
        """Ends every worker (they would end on their own after ``IDLE_SECONDS``)."""
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


_pool: WorkerPool | None = None
_pool_lock = threading.Lock()


def pool_started() -> bool:
    """Whether this process has started its pool (its workers may still be alive)."""
    return _pool is not None


def shared_pool() -> WorkerPool:
    """The process's pool of ``process_workers()`` workers (created at first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = WorkerPool(max(1, process_workers()))
        return _pool


def compile_request(request: Request) -> str | None:
    """In a worker: compiles ``request`` with Triton's own ``preload``, for the named
    target rather than a device's (``_TargetOnly``), then builds its C launcher (both
    land in Triton's disk cache); returns why the launcher was not built, if it was not."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    target = GPUTarget(*request.target)
    driver.set_active(_TargetOnly(target))
    fn = getattr(importlib.import_module(request.module), request.name)
    jit_keys.settle()  # (the key the parent's ``load`` looks up: settled there too)
    return _build_launcher(fn.preload(request.spec), target)


class _TargetOnly:
    """What Triton's ``preload`` asks of the active driver, answered without a device:
    device 0, of the parent's target. A worker never launches, so nothing else is asked."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


def _build_launcher(kernel: Any, target: Any) -> str | None:
    """Builds the kernel's C launcher into Triton's cache, which its first launch
    otherwise does (0.3-0.4 s each, one after another, on the launching thread); the
    error where it cannot (no CUDA driver library here): the launch then builds it."""
    if target.backend != "cuda":
        return None
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
    except Exception as e:  # not the compile's failure: the first launch builds it
        return f"{type(e).__name__}: {e}"
    return None


def main() -> None:
    """A worker: one JSON ``Request`` a line on stdin, one JSON reply a line on stdout
    (``{"error": ..., "launcher": ...}``: the compile's error and why the launcher was
    not built, each null where there was none); exits at end of input or after
    ``IDLE_SECONDS`` without a request."""
    # The parent sends a request only after the reply to the last one, so no line ever
    # waits in stdin's buffer while select() watches the descriptor.
    # Ctrl-C reaches the whole process group: the parent decides, and a worker ends at
    # the end of its input when the parent does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], IDLE_SECONDS)
        line = sys.stdin.readline() if ready else ""
        if not line:
            return
        error = launcher = None
        try:
            launcher = compile_request(Request(**json.loads(line)))
        except Exception as e:  # reported to the parent, which raises it there
            error = f"{type(e).__name__}: {e}"
        sys.stdout.write(json.dumps({"error": error, "launcher": launcher}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
