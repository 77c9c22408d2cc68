"""The CUDA platform (also ROCm/HIP, which PyTorch exposes through the same API)."""

from __future__ import annotations

import contextlib
import inspect
import statistics
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ostinato import steps_first
from ostinato.platform.base import (
    Graph,
    Held,
    Platform,
    capture_is_isolated,
    exclusive_device,
    paused_collection,
)


class CudaPlatform(Platform):
    """CUDA graphs through ``torch.cuda.CUDAGraph`` on the current device."""

    device_type = "cuda"
    supports_graphs = True

    def __init__(self) -> None:
        self.name = "rocm" if torch.version.hip else "cuda"
        # (Recording beside running steps was measured on CUDA only: HIP keeps the turn.)
        self.records_apart = torch.version.hip is None
        self._capture_stream: torch.cuda.Stream | None = None
        # Pools retired after a failed capture, and the pool that replaces each.
        self._pool_replacements: dict[Any, Any] = {}
        self._pool_keepers: list[torch.cuda.CUDAGraph] = []
        self._keeper_buffer: torch.Tensor | None = None

    def new_graph(self) -> Graph:
        return torch.cuda.CUDAGraph()

    def graph_pool_handle(self) -> Any:
        """A new pool that stays valid for the life of the process.

        PyTorch frees a pool once the last graph captured into it is destroyed, and a
        later capture into the same handle then fails an internal assert. A keeper graph
        (one kernel, no allocation) holds every pool we hand out, so graphs may come and
        go freely.
        """
        pool = torch.cuda.graph_pool_handle()
        # Outside inference mode: a buffer made inside it is an inference tensor, which
        # a later call outside inference mode (the pool recovery after a failed capture)
        # may not write to.
        with torch.inference_mode(False), exclusive_device(), paused_collection(torch.cuda):
            if self._keeper_buffer is None:
                self._keeper_buffer = torch.zeros(1, device="cuda")
            keeper = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.stream(self._stream()):
                keeper.capture_begin(pool=pool)
                self._keeper_buffer.zero_()
                keeper.capture_end()
        self._pool_keepers.append(keeper)
        return pool

    def _stream(self) -> torch.cuda.Stream:
        # Capture needs a non-default stream; one stream serves every capture so that
        # graphs sharing a pool are recorded in order.
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
        return self._capture_stream

    @contextlib.contextmanager
    def capture(self, graph: Graph, pool: Any) -> Iterator[None]:
        """Records into ``graph`` on the platform's capture stream, into ``pool``.

        A failed capture leaves the device usable: the RNG is reset, and ``pool`` is
        retired (PyTorch refuses to capture into a pool after a failed capture in it),
        so later captures asked for ``pool`` go to a fresh pool. The failed pool's
        memory stays reserved until the process ends.
        """
        assert isinstance(graph, torch.cuda.CUDAGraph)
        # Name the pool even when none was given: recovery needs its id, and a graph
        # cannot report it after failing.
        requested = pool if pool is not None else self.graph_pool_handle()
        pool = self._pool_replacements.get(requested, requested)
        with _capture_scope(self._stream()) as mode:
            try:
                graph.capture_begin(pool=pool, capture_error_mode=mode)
            except Exception:
                self._reset_rng_capture_state()
                raise
            with _ended(graph, lambda: self._recover_from_failed_capture(requested, pool)):
                yield

    def _recover_from_failed_capture(self, requested: Any, pool: Any) -> None:
        # A capture_end that fails stops early: the allocator still routes this
        # capture's allocations into the pool, and the RNG generator stays marked as
        # capturing (every later random op fails: "Offset increment outside graph
        # capture"). Even with routing ended, PyTorch (2.11) refuses further captures
        # into that pool ("already recording to mempool_id"), so it is replaced.
        with contextlib.suppress(Exception):
            torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
        self._pool_replacements[requested] = self.graph_pool_handle()
        self._reset_rng_capture_state()

    def _reset_rng_capture_state(self) -> None:
        # A throwaway capture that ends cleanly clears the generator's capture mark.
        scratch = torch.cuda.CUDAGraph()
        scratch.capture_begin()
        torch.empty(1, device="cuda").zero_()
        scratch.capture_end()
        scratch.reset()

    def held_seconds(self, fn: Callable[[], object], calls: int, held: Held) -> float:
        """By the device's clock (``held_calls_us``): the host's delays count only where
        one holds a launch back past the spin queued ahead of the calls."""
        return held_calls_us(fn, calls, held) / 1e6

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved()

    def pool_bytes(self, pool: Any) -> int:
        # The pool's own segments: memory_reserved would also count what other code
        # (a library's workspace, the default pool) allocates while a graph is captured.
        return sum(s["total_size"] for s in pool_segments(pool))

    def device_used_memory(self) -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def device_memory(self) -> tuple[int, int] | None:
        free, total = torch.cuda.mem_get_info()
        return free, total

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def revocable(self, alias: Any) -> Any | None:
        # Inductor's cudagraph trees revoke reduce-overhead's outputs the same way: the
        # alias's own storage gets an error for a data pointer (torch's CUDA bindings only,
        # hence the check).
        if not _CAN_REVOKE or alias.device.type != "cuda":
            return None
        return StorageWeakRef(alias.untyped_storage())

    def revoke(self, handle: Any, message: str) -> None:
        if not handle.expired():
            torch._C._set_storage_data_ptr_access_error_msg(handle.cdata, message)

    @contextlib.contextmanager
    def sync_errors(self) -> Iterator[None]:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


# What this torch's ``memory_snapshot`` can be asked (``mempool_id``, ``include_traces``).
_SNAPSHOT_ASKS = frozenset(inspect.signature(torch.cuda.memory_snapshot).parameters)


def pool_segments(pool: Any) -> list[dict[str, Any]]:
    """The caching allocator's segments of the graph pool ``pool``. Asked of torch for
    that pool alone and without traces where it takes those arguments: a snapshot of
    every segment (and block) of a serving process takes milliseconds, and each capture
    takes two, holding the step turn in a background start."""
    if "mempool_id" not in _SNAPSHOT_ASKS:
        segments = torch.cuda.memory_snapshot()
        return [s for s in segments if tuple(s["segment_pool_id"]) == tuple(pool)]
    light = {"include_traces": False} if "include_traces" in _SNAPSHOT_ASKS else {}
    return torch.cuda.memory_snapshot(mempool_id=tuple(pool), **light)


HELD_REPLAY_US = 500.0
"""Device µs one held timed replay may take (``graph_call_us`` with a turn): a graph of
calls longer than that holds fewer calls, so a step waits for about one replay of it."""

LEAD_CYCLES = 100_000
"""Cycles the device spins before a held timed replay (about 50 µs on an H200): the
host's launch of the replay lands inside them, so the timing starts as the device
reaches the replay, not when the host launched it."""


def graph_call_us(
    fn: Callable[[], object], calls: int, replays: int = 5, turn: Held | None = None
) -> float:
    """Device µs per call of ``fn``, captured ``calls`` times back to back in one CUDA
    graph and replayed: launch cost on the host is out of it, every kernel ``fn``
    launches (and the gaps between them) is in it. Run ``fn`` once eagerly first where
    lazy set-up must not be captured.

    Without ``turn``: one untimed replay, then ``replays`` back to back under one pair
    of events, their mean. With ``turn`` (a background measurement beside steps): the
    capture outside it, which runs nothing (``fn`` must touch nothing a step uses), then
    ``held_replays_us``: a step waits for one timed replay of about ``HELD_REPLAY_US``
    at most (``held_calls``) queued ahead of it, not the whole measurement."""
    with timing_pool():
        if turn is not None:
            held = held_calls(fn, calls, turn)
            graph = captured_calls(fn, held)
            # Fewer calls per replay: more replays, up to four times (a median as steady).
            more = min(4, -(-calls // held))
            us = held_replays_us(graph, replays * more, turn) / held
        else:
            graph = captured_calls(fn, calls)
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) * 1e3 / (replays * calls)
        del graph  # (before its pool may end)
    return us


def held_calls(fn: Callable[[], object], calls: int, turn: Held) -> int:
    """How many of ``calls`` calls of ``fn`` one held replay takes: as many as fit
    ``HELD_REPLAY_US`` by one held replay of one call (at least one, at most ``calls``)."""
    if calls <= 1:
        return calls
    one = captured_calls(fn, 1)
    us = held_replay_us(one, turn)
    del one
    return max(1, min(calls, int(HELD_REPLAY_US / max(us, 1e-3))))


def captured_calls(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """``calls`` calls of ``fn`` back to back, captured into one CUDA graph, the device's
    other work drained first; no cache emptied. Its memory comes from this thread's
    ``timing_pool`` where one is open, else from a pool of its own (cached after the
    graph is deleted until the allocator empties its cache: open a ``timing_pool``
    around many). On a thread beside the steps the recording pauses while a step
    launches (``ostinato.steps_first``): a measurement beside the steps is mostly such
    recordings."""
    graph = torch.cuda.CUDAGraph()
    pool = _open_timing_pool()
    # Not ``torch.cuda.graph``: it empties the device's and the pinned host's caches at
    # every capture (each free waits for the device, and the steps' next allocations are
    # made again), hundreds of times over a measurement beside the steps.
    with _capture_scope(_side_stream(), pauses=True) as mode:
        graph.capture_begin(pool=None if pool is None else pool.id, capture_error_mode=mode)
        with _ended(graph, None if pool is None else _retire_timing_pool):
            for _ in range(calls):
                fn()
    return graph


_timing = threading.local()  # ``pools``: this thread's open ``timing_pool``, or None


@contextlib.contextmanager
def timing_pool() -> Iterator[None]:
    """The timing graphs this thread captures inside (``captured_calls``,
    ``graph_call_us``) take their memory from one pool per device, made at the first
    capture on that device and freed when the outermost ``timing_pool`` ends; a nested
    one is the outer one. So a measurement of hundreds of graphs, each deleted before the
    next, holds about one graph's memory, not their sum. A no-op where CUDA is not
    available.

    Why: a graph's own pool keeps its memory cached once the graph is deleted, and the
    allocator frees such memory only when its cache is emptied or when an allocation
    fails outside every capture. The 8 B shape's GEMM plans (a blocking capture, each
    graph with its own cuBLAS workspace) left 41 GiB so, and the decode benchmark ran out
    of an H100's 80 GB inside a capture."""
    if getattr(_timing, "pools", None) is not None or not torch.cuda.is_available():
        yield
        return
    _timing.pools = {}
    try:
        yield
    finally:
        pools, _timing.pools = _timing.pools, None
        # Their memory freed (cudaFree, which waits for the device): not in the middle of
        # another thread's capture.
        with exclusive_device():
            for pool in pools.values():
                pool.close()


def _open_timing_pool() -> _TimingPool | None:
    """The current device's pool of this thread's open ``timing_pool`` (made now where
    this is its first capture there), or None outside one."""
    pools = getattr(_timing, "pools", None)
    if pools is None:
        return None
    device = torch.cuda.current_device()
    if device not in pools:
        pools[device] = _TimingPool()
    return pools[device]


class _TimingPool:
    """A ``torch.cuda.MemPool`` on the current device and a keeper graph (one kernel, no
    allocation) captured into it first: PyTorch (2.11) keeps a pool's pinned-host side
    alive only while a graph holds it, and asserts at the next capture into a pool whose
    graphs all went."""

    def __init__(self) -> None:
        self.pool: Any = torch.cuda.MemPool()
        self.id = self.pool.id
        self.keeper: Any = torch.cuda.CUDAGraph()
        with _capture_scope(_side_stream(), pauses=True) as mode:
            self.keeper.capture_begin(pool=self.id, capture_error_mode=mode)
            with _ended(self.keeper):
                torch.cuda._sleep(1)

    def close(self) -> None:
        """The keeper let go, then the pool (whose end frees its cached memory)."""
        self.keeper = None
        self.pool = None


def _retire_timing_pool() -> None:
    """After a capture into the thread's timing pool failed to end: the allocator still
    routes this thread's allocations to that pool and refuses another capture into it,
    so the routing ends and the next capture makes a fresh pool."""
    device = torch.cuda.current_device()
    pool = _timing.pools.pop(device)
    with contextlib.suppress(Exception):
        torch._C._cuda_endAllocateToPool(device, pool.id)
    pool.close()


_CAN_REVOKE = hasattr(torch._C, "_set_storage_data_ptr_access_error_msg")
# Set once a capture ran beside steps: its workspace stays cached, maybe read by graphs of
# several pools (a thread's handle and the capture stream key it, whatever the pool), so
# dropping it would free memory those graphs still write. From then on none is dropped.
_KEPT_WORKSPACES = threading.Event()


@contextlib.contextmanager
def _capture_scope(stream: torch.cuda.Stream, pauses: bool = False) -> Iterator[str]:
    """What every capture here opens: the device to this thread's capture
    (``exclusive_device``), the garbage collector paused, ``stream`` current, the device
    drained, cuBLAS's workspaces as ``cublas_workspaces_in_capture`` says, and no pause
    for the steps unless ``pauses`` (``ostinato.steps_first``); yields the capture's
    error mode ("thread_local" beside steps, else "global")."""
    with exclusive_device(), paused_collection(torch.cuda), torch.cuda.stream(stream):
        torch.cuda.synchronize()
        with (
            cublas_workspaces_in_capture(),
            contextlib.nullcontext() if pauses else steps_first.unpaused(),
        ):
            yield "thread_local" if capture_is_isolated() else "global"


@contextlib.contextmanager
def cublas_workspaces_in_capture() -> Iterator[None]:
    """Around a blocking capture (not ``isolated_capture()``) in a process where no capture
    has run beside steps, on the device drained: cuBLAS's cached workspaces are dropped
    before it and after it, so the capture's own workspace is made in its graph's pool and
    freed there when it ends, a temporary like the graph's others. Otherwise nothing is
    dropped.

    Why: cuBLAS keeps one workspace (32 MiB on Hopper) per (thread's handle, stream) for
    the life of the process. Kept, the capture stream's lands in the pool and stays
    allocated after every graph is released, and each thread that ran a GEMM (a compile's
    warm-up) holds one more: 99 MiB left behind by a released ``graphed`` model on an H200.
    Why not beside steps: dropping is process-wide, and a step thread between fetching its
    workspace and launching its GEMM would launch into freed memory; a blocking capture
    already requires that no other thread use the device meanwhile.
    """
    # (Inductor's cudagraph trees drop them the same way; a torch built without CUDA,
    # which the CPU tests dress up as CUDA, has no workspaces to drop)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if capture_is_isolated():
        _KEPT_WORKSPACES.set()
    if clear is None or _KEPT_WORKSPACES.is_set():
        yield
        return
    clear()
    try:
        yield
    finally:
        clear()


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # by device: a capture's own stream


def _side_stream() -> torch.cuda.Stream:
    device = torch.cuda.current_device()
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


@contextlib.contextmanager
def _ended(graph: Any, recover: Callable[[], None] | None = None) -> Iterator[None]:
    """Ends ``graph``'s capture after the block. Where ending fails, ``recover`` runs,
    and the error is raised unless the block's own is: after a failed block, ending the
    invalid capture raises a second, vaguer error ("failed due to a previous error")."""
    body_failed = False
    try:
        yield
    except BaseException:
        body_failed = True
        raise
    finally:
        try:
            graph.capture_end()
        except Exception:
            if recover is not None:
                recover()
            if not body_failed:
                raise


def held_replays_us(graph: Any, replays: int, turn: Held) -> float:
    """The median µs of ``replays`` timed replays of ``graph``, each inside a ``turn()``
    of its own (``held_replay_us``). What the graph reads must be its own, or written
    again in each turn: steps run between."""
    return statistics.median(held_replay_us(graph, turn) for _ in range(replays))


def held_replay_us(graph: Any, turn: Held) -> float:
    """µs of one replay of ``graph``, queued inside ``turn()`` on the current stream, the
    one the steps share: the device runs what the steps queued before the turn, then
    ``LEAD_CYCLES`` of spinning, then the timed replay, in that order, so the timing
    starts as the replay does (not when the host launched it) and no step's work shares
    it. The turn is let go once the replay is queued: a step waits for the queueing, and
    the device for the spin and the replay, not for a drain of the steps' work (which
    left the device idle while the next step was launched). Work on another stream would
    share the replay's time (the engine's steps use the current one)."""

    @contextlib.contextmanager
    def exclusive_turn() -> Iterator[None]:
        with turn(), exclusive_device():
            yield

    return held_calls_us(graph.replay, 1, exclusive_turn)


def held_calls_us(fn: Callable[[], object], calls: int, held: Held) -> float:
    """µs of ``calls`` calls of ``fn`` back to back (work it queues on the current
    stream), queued inside ``held()`` behind ``LEAD_CYCLES`` of spinning and timed by
    events around them (``held_replay_us``: what was queued before does not count, nor a
    delay of the host's shorter than the spin); ``held()`` is let go once they are
    queued, and the wait for their end happens outside it."""
    _warm_timing()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with held():
        torch.cuda._sleep(LEAD_CYCLES)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


_TIMING_WARM: set[int] = set()  # devices whose spin and timed events have run once


def _warm_timing() -> None:
    """The spin kernel and a timed event pair run once per device before the first held
    replay, outside any turn: their first launch loads them (8.5 ms of one hold on an
    H200, where a replay took 0.4 ms)."""
    device = torch.cuda.current_device()
    if device in _TIMING_WARM:
        return
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1)
    end.record()
    end.synchronize()
    start.elapsed_time(end)
    _TIMING_WARM.add(device)
