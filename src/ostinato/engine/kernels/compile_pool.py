"""Compiling the engine's Triton kernels in worker processes, for ``compile_ahead``.

Triton's compiler front end holds the GIL, so compile threads take as long as one
(measured on an H200's 16 cores: 166 kernels in 15.9 s on 8 threads, 16.0 s on 16).
Here the launches of a ``compile_ahead()`` block are collected instead
(``Collector``, Triton's ``jit_cache_hook``: it records each warm-up's specialisation of
an ostinato kernel and skips its compile), compiled by worker processes
(``WorkerPool``: ``python -m ostinato.engine.kernels.compile_pool``, one JSON request a
line, each compile written to Triton's disk cache, with its C launcher built), and then
loaded in this process from that cache (``Collector.load``, Triton's ``preload``).
While the workers compile, a launch on another thread that needs one of our kernels (a
step of a background start, on an empty cache) asks the pool for it ahead of the queue
and reads it from the disk cache, instead of compiling it where it was launched, one
after the other, holding the GIL beside the steps (``WorkerPool.ensure``).

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
import itertools
import json
import os
import pkgutil
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ostinato.engine.kernels import jit_keys, triton_warmup

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
    other threads, other kernels and real launches compile as usual, except that while
    ``compile_in`` runs a real launch's compile of an ostinato kernel, on any thread, is
    first asked of the pool ahead of its queue and then read from the disk cache.
    ``end_block`` ends the recording; ``load`` reads each recorded kernel from Triton's
    disk cache into its function. Collectors may overlap (two engines starting at once):
    one hook serves them all, and the hook that was set before the first is called first
    and put back after the last."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self._functions: dict[tuple[str, str], Any] = {}  # (module, name) -> JITFunction
        self._seen: set[tuple[int, object, str]] = set()
        self.pool: WorkerPool | None = None  # while ``compile_in`` runs
        self._token: Any = None

    def __enter__(self) -> Collector:
        _hooks.add(self)
        self._token = _collecting.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.end_block()
        _hooks.remove(self)

    def end_block(self) -> None:
        """Stops recording this thread's warm-ups (they compile as usual after)."""
        if self._token is not None:
            _collecting.reset(self._token)
            self._token = None

    def record(self, jit: Any, compile: dict, key: str) -> None:
        """Records a warm-up of ``jit`` (Triton's ``compile`` arguments of the hook)."""
        seen = (id(jit), compile["device"], key)
        if seen not in self._seen:
            self._seen.add(seen)
            self._functions[(jit.fn.__module__, jit.fn.__qualname__)] = jit
            self.requests.append(_request(jit, compile))

    def compile_in(self, pool: WorkerPool, first: bool = False) -> None:
        """Compiles every recorded request in ``pool`` (``WorkerPool.compile``). Meanwhile
        a launch that would compile one of our kernels here, on another thread (the steps
        of a background start, on an empty cache), asks the pool for it ahead of the
        queue and waits, then reads it from the disk cache: compiled beside the others
        rather than on the launching thread, one after the other. ``first``: ahead of
        the pool's queue (``WorkerPool.compile``)."""
        self.pool = pool
        try:
            pool.compile(self.requests, first)
        finally:
            self.pool = None

    def load(self) -> None:
        """Reads every recorded kernel into its function (a disk-cache hit after the
        workers, their keys and ours settled alike: ``jit_keys``; a compile here where
        there was none). Call after the block."""
        jit_keys.settle()
        for r in self.requests:
            self._functions[(r.module, r.name)].preload(r.spec)


class _Hooks:
    """Triton's ``jit_cache_hook`` while any ``Collector`` is open: records a collecting
    thread's warm-ups in its collector, and asks a compiling collector's pool for a real
    launch's kernel (``Collector.compile_in``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[Collector] = []
        self._outer: Any = None  # the hook set before the first collector opened

    def add(self, collector: Collector) -> None:
        import triton

        with self._lock:
            if not self._open:
                self._outer = triton.knobs.runtime.jit_cache_hook
                triton.knobs.runtime.jit_cache_hook = self.hook
            self._open.append(collector)

    def remove(self, collector: Collector) -> None:
        import triton

        with self._lock:
            self._open.remove(collector)
            if not self._open:
                triton.knobs.runtime.jit_cache_hook, self._outer = self._outer, None

    def hook(self, *, fn: Any, compile: dict, is_manual_warmup: bool, **kwargs: Any) -> bool:
        # A hook someone set before (a test's, a profiler's) still sees every compile.
        outer = self._outer
        if outer is not None and outer(
            fn=fn, compile=compile, is_manual_warmup=is_manual_warmup, **kwargs
        ):
            return True
        jit = fn.jit_function
        if not getattr(jit.fn, "__module__", "").startswith("ostinato."):
            return False
        if is_manual_warmup:
            collector = _collecting.get()
            if collector is None or collector not in self._open:
                return False
            collector.record(jit, compile, kwargs["key"])
            return True  # compiled elsewhere; ``load`` brings it here
        pool = next((c.pool for c in list(self._open) if c.pool is not None), None)
        if pool is not None:
            try:
                pool.ensure(_request(jit, compile))
            except WorkerError:
                pass  # compiled here, as without the pool (its error, if any, raised here)
        return False


_hooks = _Hooks()


def _request(jit: Any, compile: dict) -> Request:
    """The ``Request`` of a compile the hook saw (Triton's ``compile`` arguments)."""
    target = jit.device_caches[compile["device"]][2]
    return Request(
        jit.fn.__module__, jit.fn.__qualname__, compile["specialization_data"], _target(target)
    )


def _target(target: Any) -> tuple[str, int | str, int]:
    return (target.backend, target.arch, target.warp_size)


class WorkerError(RuntimeError):
    """A worker could not compile a kernel (its message is the worker's error)."""


class _Worker:
    """One ``python -m ostinato.engine.kernels.compile_pool`` process, importing the
    modules ``preload`` names as it starts."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # it builds code, never runs it
        # The parent's import path, so the worker imports the same ostinato and kernels.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # A file, not a pipe: a worker's warnings never fill a buffer nobody reads.
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ostinato.engine.kernels.compile_pool", *preload],
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


@dataclass(eq=False)
class _Job:
    """One request in a ``WorkerPool``: queued, then under way, then done (``error``
    where it failed or was cancelled)."""

    request: Request
    batch: int  # the ``compile`` call that queued it (0: ``ensure``)
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    error: BaseException | None = None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class WorkerPool:
    """``workers`` compile processes, started at first use (or ahead, by ``start``) and
    kept while they live (each exits after ``IDLE_SECONDS`` without requests; a dead one
    is replaced). One queue feeds them: ``compile`` adds to its end, ``ensure`` to its
    front; a request queued or under way is compiled once, whoever asks."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"WorkerPool: workers must be >= 1, got {workers}")
        self.workers = workers
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._pending: dict[Request, _Job] = {}  # queued or under way
        self._threads = 0  # feeding the workers; each ends when the queue is empty
        self._batches = itertools.count(1)
        self._preload: tuple[str, ...] = ()  # what a worker imports as it starts

    def start(self, preload: Iterable[str] = ()) -> None:
        """Starts every worker not running now (those gone idle replaced), each
        importing the modules ``preload`` names as it starts, and returns at once. Why:
        a worker's start (the import of torch, Triton and the kernels: seconds, 16 at
        once) then overlaps what the caller does before its first ``compile``."""
        self._preload = tuple(preload)
        with self._lock:
            if self._threads:
                return  # (compiling: every worker is started or about to be)
            alive = []
            while not self._idle.empty():
                worker = self._idle.get_nowait()
                if worker.alive():
                    alive.append(worker)
                else:
                    worker.close()
            alive += [_Worker(self._preload) for _ in range(self.workers - len(alive))]
            for worker in alive:
                self._idle.put(worker)

    def compile(self, requests: Iterable[Request], first: bool = False) -> None:
        """Compiles every request into Triton's disk cache, ``workers`` at a time;
        raises the first failure (``WorkerError``, or an interrupt) once the compiles
        under way have ended, the requests not yet started cancelled. ``first``: ahead
        of every queued request (a step's own kernels), in their order."""
        jobs = self._submit(list(requests), batch=next(self._batches), first=first)
        try:
            for job in jobs:
                job.wait()
        finally:
            self._cancel(jobs)
            for job in jobs:
                job.done.wait()

    def ensure(self, request: Request) -> None:
        """Compiles ``request`` ahead of every queued one, or waits for it where it is
        under way already; ``WorkerError`` where it fails or is cancelled."""
        (job,) = self._submit([request], batch=0, first=True)
        job.wait()

    def _submit(self, requests: list[Request], batch: int, first: bool) -> list[_Job]:
        jobs = []
        with self._lock:
            # (to the front in reverse, so that they leave it in their order)
            for request in reversed(requests) if first else requests:
                job = self._pending.get(request)
                if job is not None and (job.started or not first):
                    jobs.append(job)  # under way, or queued where a later one would go
                    continue
                if job is None:
                    job = self._pending[request] = _Job(request, batch)
                else:
                    self._queue.remove(job)  # (to the front, below)
                (self._queue.appendleft if first else self._queue.append)(job)
                jobs.append(job)
            more = min(self.workers, self._threads + len(self._queue)) - self._threads
            self._threads += max(0, more)
        for _ in range(more):
            threading.Thread(target=self._feed, name="ostinato-compile", daemon=True).start()
        return jobs[::-1] if first else jobs

    def _feed(self) -> None:
        """A thread's loop: the queue's first request to a worker, until it is empty."""
        while True:
            with self._lock:
                if not self._queue:
                    self._threads -= 1
                    return
                job = self._queue.popleft()
                job.started = True
            try:
                self._one(job.request)
            except BaseException as exc:  # (raised again by whoever waits for it)
                job.error = exc
            with self._lock:
                self._pending.pop(job.request, None)
                if job.error is not None and job.batch:  # its call's others: cancelled now
                    self._cancel_queued([j for j in self._queue if j.batch == job.batch])
            job.done.set()

    def _cancel(self, jobs: list[_Job]) -> None:
        """Takes ``jobs`` not yet started off the queue; they end with a ``WorkerError``."""
        with self._lock:
            self._cancel_queued(jobs)

    def _cancel_queued(self, jobs: list[_Job]) -> None:
        for job in jobs:  # (the lock held)
            if job.started or job.done.is_set():
                continue
            self._queue.remove(job)
            self._pending.pop(job.request, None)
            r = job.request
            job.error = WorkerError(f"compiling {r.module}.{r.name}: cancelled")
            job.done.set()

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
                return _Worker(self._preload)
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


def start_for_a_cold_cache(environ: Mapping[str, str] = os.environ) -> bool:
    """Starts the shared pool's workers now, each importing the kernel modules as it
    starts, where Triton's cache folder (``TRITON_CACHE_DIR``, else Triton's default) is
    missing or empty and this host uses workers; returns whether it did. Why: on such a
    start every kernel compiles, and a worker takes 3-4 s to start (torch's import);
    started when the engine plans its kernels, the workers were not ready for the first
    steps (an H200's first 1.5 B step compiled its kernels on threads, 5.2-6.8 s).
    Imports neither torch nor Triton; call it before anything writes to that folder."""
    if process_workers() == 0:
        return False
    home = Path(environ.get("TRITON_HOME") or Path.home())
    folder = Path(environ.get("TRITON_CACHE_DIR") or home / ".triton" / "cache")
    if folder.is_dir() and any(folder.iterdir()):
        return False
    package = Path(__file__).parent
    names = sorted(m.name for m in pkgutil.iter_modules([str(package)]) if m.name != "compile_pool")
    shared_pool().start([f"{__package__}.{name}" for name in names])
    return True


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
    return build_launcher(fn.preload(request.spec), target)


class _TargetOnly:
    """What Triton's ``preload`` asks of the active driver, answered without a device:
    device 0, of the parent's target. A worker never launches, so nothing else is asked."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


def build_launcher(kernel: Any, target: Any) -> str | None:
    """Builds the kernel's C launcher into Triton's cache, which its first launch
    otherwise does (0.3-0.8 s each, one after another, on the launching thread); the
    error where it cannot (no CUDA driver library here): the launch then builds it.
    The C compiler runs outside the interpreter's lock: threads build side by side."""
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
    # Triton's cache key, which a worker's first compile needs (a hash of Triton's 400 MB
    # library: 2.6 s on an H200 host, every worker's first request waited for it), made
    # beside the imports below (torch's: seconds), outside the interpreter's lock.
    key = threading.Thread(target=triton_warmup.warm_key, name="ostinato-triton-key")
    key.start()
    for name in sys.argv[1:]:  # (``WorkerPool.start``: imported before the first request)
        try:
            importlib.import_module(name)
        except Exception:
            pass  # a request that needs it reports the error
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], IDLE_SECONDS)
        line = sys.stdin.readline() if ready else ""
        if not line:
            return
        key.join()  # (computing it a second time beside it would be no sooner)
        error = launcher = None
        try:
            launcher = compile_request(Request(**json.loads(line)))
        except Exception as e:  # reported to the parent, which raises it there
            error = f"{type(e).__name__}: {e}"
        sys.stdout.write(json.dumps({"error": error, "launcher": launcher}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
