"""Launching ostinato's Triton kernels, or only compiling them, together, ahead.

A cold start-up compiles each of the engine's kernels at its first launch, one after the
other, in the middle of the first forward pass. Inside ``compile_ahead()`` a launch
through ``launch`` starts its kernel's compilation for those arguments on a pool of
threads instead (``triton.AsyncCompileMode``; Triton's compiler passes and ``ptxas``
release the GIL) and runs nothing, so an eager pass over the model queues every
kernel's compilation in a few milliseconds and the compilations proceed together, and
beside whatever the caller does next in the block (Dynamo's trace, Inductor). On a host
of 4 cores or more they are collected instead and, where there are many, compiled in
worker processes (``compile_pool``: threads share one GIL with Triton's front end)
when the block ends. Leaving the block waits for all of them; each then sits in its
kernel's cache, and a later launch with arguments of the same layout (dtypes,
alignment, the integers Triton specialises on) compiles nothing.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

import torch

from ostinato.engine.kernels import compile_pool, jit_keys
from ostinato.engine.kernels.launch_rules import rules
from ostinato.steps_first import pause_point

# Fewer kernels than this compile on threads unless the workers run already: a worker's
# start (torch's import, 3-4 s) costs more than the GIL does them.
PROCESS_MIN_KERNELS = 16

_ahead: ContextVar[bool] = ContextVar("ostinato_triton_compile_ahead", default=False)
_no_pdl: ContextVar[bool] = ContextVar("ostinato_without_pdl", default=False)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``; inside ``compile_ahead()`` only the kernel's
    compilation for these arguments starts, and nothing runs (outputs stay unwritten).
    On a thread beside the steps, it first waits while a step launches
    (``ostinato.steps_first``: its warm-ups, recordings and timings are made of these)."""
    pause_point()
    if _ahead.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def compiling_ahead() -> bool:
    """True inside ``compile_ahead()``: launches only compile."""
    return _ahead.get()


def default_workers() -> int:
    """Compile threads: one per core, at most 8 (the engine has fewer kernels)."""
    return max(1, min(8, os.cpu_count() or 1))


@contextlib.contextmanager
def compile_ahead(workers: int | None = None, first: bool = False) -> Iterator[None]:
    """Inside, ``launch`` compiles instead of running (see the module docstring); on exit
    every compilation started inside has finished (a failed one raises here). With a
    Triton older than ``AsyncCompileMode`` (3.4) each compiles where it is launched,
    one after the other, still without running. ``first`` (a dozen kernels a step needs
    now): ahead of the worker processes' queue where they were started, else on
    threads, never waiting for workers to start. Not re-entrant."""
    if workers is not None and workers < 1:
        raise ValueError(f"compile_ahead: workers must be >= 1, got {workers}")
    if _ahead.get():
        raise RuntimeError("compile_ahead: already inside compile_ahead()")
    token = _ahead.set(True)
    try:
        import triton

        jit_keys.settle()  # keys as another process computes them (its disk cache)
        mode = getattr(triton, "AsyncCompileMode", None)
        if mode is None:
            yield
        elif _collects() and (not first or compile_pool.pool_started()):
            with compile_pool.Collector() as collector:
                yield
                collector.end_block()
                _compile_collected(collector, mode, workers, first)
        else:
            with _threads(workers) as pool:
                with mode(pool) as compiling:
                    yield
                _build_launchers(pool, compiling)
    finally:
        _ahead.reset(token)


def start_workers() -> None:
    """Starts ``compile_ahead``'s worker processes now, where it would use them, each
    importing the kernel modules loaded here as it starts (``WorkerPool.start``): the
    block that follows finds them ready instead of waiting seconds for their start."""
    if _collects():
        kernels = [m for m in sys.modules if m.startswith("ostinato.engine.kernels.")]
        compile_pool.shared_pool().start(sorted(kernels))


def _collects() -> bool:
    """Whether ``compile_ahead`` collects its launches for the worker processes: a Triton
    with ``AsyncCompileMode`` (3.4) and the collector's hooks, on enough cores."""
    if not compile_pool.supported():  # (False without Triton)
        return False
    import triton

    asynchronous = getattr(triton, "AsyncCompileMode", None) is not None
    return asynchronous and compile_pool.process_workers() > 0


def _threads(workers: int | None) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers or default_workers(), "ostinato-triton")


def _build_launchers(pool: ThreadPoolExecutor, compiling: Any) -> None:
    """The C launcher of every kernel ``compiling`` (Triton's ``AsyncCompileMode``, ended)
    compiled, built on ``pool``'s threads side by side: each kernel's first launch
    would otherwise build its own, one after another (an H200's first 1.5 B step spent
    2.8 s so after its kernels had compiled on threads)."""
    futures = getattr(compiling, "future_kernels", {})  # (Triton's internals: 3.6)
    kernels = [f.kernel for f in futures.values() if getattr(f, "kernel", None) is not None]
    build = compile_pool.build_launcher
    list(pool.map(lambda kernel: build(kernel, kernel.metadata.target), kernels))


def _compile_collected(
    collector: compile_pool.Collector, mode: Any, workers: int | None, first: bool = False
) -> None:
    """Compiles what ``collector`` recorded: in worker processes (ahead of their queue
    where ``first``) where there are at least ``PROCESS_MIN_KERNELS`` or the workers
    were started already (then each is a disk-cache hit here), else on threads."""
    many = len(collector.requests) >= PROCESS_MIN_KERNELS
    if collector.requests and (many or compile_pool.pool_started()):
        collector.compile_in(compile_pool.shared_pool(), first)
        collector.load()
        return
    with _threads(workers) as pool, mode(pool):
        collector.load()


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the CUDA ``device`` (the current one without an
    index): what a kernel's grid is sized against."""
    return _sms(device.index if device.index is not None else torch.cuda.current_device())


def pdl_for(pdl: bool, rows: int) -> bool:
    """Whether a launch over ``rows`` rows (tokens) uses PDL when ``pdl`` asks for it
    (``LaunchRules.pdl_max_rows``), outside ``without_pdl()``."""
    return pdl and rows <= rules().pdl_max_rows and not _no_pdl.get()


@contextlib.contextmanager
def without_pdl(off: bool = True) -> Iterator[None]:
    """With ``off``, this thread's launches inside the block use no PDL, whatever their
    callers ask (``pdl_for``): a step of a size where PDL measured slower
    (``DecoderModel.no_pdl_rows``), or a timing of that variant. A graph captured inside
    keeps the launches it recorded; other threads' launches are untouched."""
    token = _no_pdl.set(off or _no_pdl.get())
    try:
        yield
    finally:
        _no_pdl.reset(token)


WAIT_THEN_TRIGGER, TRIGGER_THEN_WAIT = 1, 2  # pdl.pdl_enter's USE_PDL, PDL on


def pdl_arg(pdl: bool) -> int:
    """The kernels' ``USE_PDL`` (``pdl.pdl_enter``) for a launch with PDL
    (``launch_pdl=True``) or without: 0 without, else the order
    ``LaunchRules.trigger_first`` says."""
    if not pdl:
        return 0
    return TRIGGER_THEN_WAIT if rules().trigger_first else WAIT_THEN_TRIGGER


def layout_rows(max_rows: int, every_up_to: int = 0) -> tuple[int, ...]:
    """Row counts (at most ``max_rows``) whose launches between them take every layout a
    step of 1 to ``max_rows`` rows takes: every count up to ``every_up_to`` (below it a
    kernel's layout follows the row count itself: the small GEMM's per-row plan entries,
    its resident launch's rows, its row statistics' granule), and above it, with and
    without PDL, each at its fewest rows (where attention splits its keys, if any such
    size does) and at its most (where it does not, if any does not), since a kernel's
    split count falls as rows grow."""
    most = rules().pdl_max_rows
    edges = (1, most, most + 1, max_rows, *range(1, every_up_to + 1))
    return tuple(sorted({n for n in edges if n <= max_rows}, reverse=True))
