"""The Platform interface: everything ostinato needs from a device backend."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, Protocol

from ostinato.errors import PlatformError
from ostinato.param_updates import UpdatableTask, UpdateOrder

# A hold of a step turn for one unit of work beside the steps: ``with held():`` around it
# (a background thread's ``BackgroundCapture.unit``; ``contextlib.nullcontext`` where no
# step runs).
Held = Callable[[], contextlib.AbstractContextManager[object]]


class Graph(Protocol):
    """A captured graph: replay re-runs the recorded kernels on the same addresses."""

    def replay(self) -> None: ...

    def reset(self) -> None: ...


class Platform(ABC):
    """A device backend. Subclasses say whether they can capture graphs at all.

    Guarantees of every implementation: ``capture`` records the work issued inside it
    into ``graph`` without running it eagerly a second time, on a stream of its own,
    with the device synchronized first; ``memory_reserved`` and ``device_used_memory``
    are in bytes and cheap to call.
    """

    name: str = "abstract"
    device_type: str = "cpu"
    supports_graphs: bool = False
    sync_before_replay: bool = False
    """True where the runtime must be synchronized before each replay (Ascend)."""
    records_apart: bool = False
    """True where ``capture`` runs nothing (it records), from a thread of its own in a
    mode that leaves other threads' device work alone (``isolated_capture``): a
    background capture then records a FULL graph beside the steps, holding their turn
    only for its dummy inputs and warm-ups (CUDA). False where capturing runs the work or
    updates host parameters shared with the steps."""
    update_order: UpdateOrder = UpdateOrder.NONE
    """Whether captured ops take host parameters that must be updated before a replay,
    and in which order (``ostinato.param_updates``); NONE registers and pays nothing."""

    @abstractmethod
    def new_graph(self) -> Graph:
        """A fresh, empty graph object."""

    @abstractmethod
    def graph_pool_handle(self) -> Any:
        """A new memory-pool handle that several captures can share."""

    @abstractmethod
    def capture(self, graph: Graph, pool: Any) -> contextlib.AbstractContextManager[None]:
        """Context in which issued device work is recorded into ``graph``."""

    def synchronize(self) -> None:  # noqa: B027 - a no-op where work is synchronous
        """Waits for all queued device work."""

    def synchronize_outside_capture(self) -> None:
        """``synchronize``, once no capture of this process is in progress: it holds
        ``exclusive_device`` while it waits, because a device-wide synchronize during
        another thread's capture fails that capture (CUDA refuses it even in thread-local
        mode), as a second engine's background work did to the first's. For threads
        that hold at most their own engine's step turn (background captures, upgrades);
        not for one holding a turn that another thread's capture waits for."""
        with exclusive_device():
            self.synchronize()

    def held_seconds(self, fn: Callable[[], object], calls: int, held: Held) -> float:
        """Seconds of ``calls`` calls of ``fn`` back to back, queued inside ``held()`` (a
        hold of the steps' turn): here by the host's clock, the device synchronized before
        and after, inside the hold. Platforms with device timers time the device instead."""
        with held():
            self.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            self.synchronize()
            return time.perf_counter() - start

    def memory_reserved(self) -> int:
        """Bytes the framework's caching allocator holds on the device."""
        return 0

    def pool_bytes(self, pool: Any) -> int:
        """Bytes the caching allocator holds for the graph pool ``pool``; where one pool's
        bytes cannot be told from the rest, all it holds (``memory_reserved``)."""
        return self.memory_reserved()

    def device_used_memory(self) -> int:
        """Bytes in use on the whole device, as the driver sees it."""
        return 0

    def device_memory(self) -> tuple[int, int] | None:
        """``(free, total)`` bytes of the device, or None where there is no device memory."""
        return None

    def empty_cache(self) -> None:  # noqa: B027 - a no-op where nothing is cached
        """Returns cached, unused blocks to the device."""

    def revocable(self, alias: Any) -> Any | None:
        """A handle with which ``revoke`` makes every access to ``alias`` (a tensor whose
        storage does not own its memory: ``tensor_views.weak_ref_tensor``) and to views of
        it raise; None where the platform cannot revoke (callers copy instead)."""
        return None

    def revoke(self, handle: Any, message: str) -> None:  # noqa: B027 - nothing revocable
        """From now on any access to the alias of ``handle`` raises ``message`` (nothing
        once the alias and its views are gone)."""

    def capture_task(self, issue: Callable[[], None]) -> tuple[Any, Any]:
        """Inside a capture: runs ``issue`` as one task group that first waits on a fresh
        external event; returns ``(handle, event)``. Platforms that update parameters."""
        raise PlatformError(f"the {self.name} platform captures no updatable tasks")

    def update_tasks(self, tasks: Sequence[UpdatableTask], step: Any, fence: Any = None) -> None:
        """On the update stream (after ``fence``, if given): re-issues each task for
        ``step`` between the platform's update begin and end, then records its event."""
        raise PlatformError(f"the {self.name} platform updates no tasks")

    def replay_fence(self) -> Any:
        """An event on the current stream after the work issued so far (for
        ``REPLAY_THEN_UPDATE``: taken before a launch, it marks the previous replay)."""
        raise PlatformError(f"the {self.name} platform has no replay fences")

    @contextlib.contextmanager
    def sync_errors(self) -> Iterator[None]:
        """Context in which a host-device synchronising op raises instead of running.

        Used to find the op that broke a capture; a no-op where the platform cannot tell.
        """
        yield


_capture_thread = threading.local()

# One capture at a time in a process (``exclusive_device``).
_device_gate = threading.RLock()


@contextlib.contextmanager
def exclusive_device() -> Iterator[None]:
    """Held by every capture ostinato makes, from before its begin to after its end, and
    by an engine while it is built or closed; re-entrant. So no two captures in a process
    overlap (each holds torch's default generator, which fails a second one), and an engine
    built while another captures in the background waits for the item in progress instead
    of breaking it with a device synchronize or a draw from that generator; the other
    engine's next item waits for the build. Device work outside ostinato does not take it:
    keep such work out of a capture in progress (``LLM.wait_for_graphs``)."""
    with _device_gate:
        yield


@contextlib.contextmanager
def isolated_capture() -> Iterator[None]:
    """Inside, this thread's captures forbid unsafe calls (syncs, allocations outside the
    pool) from this thread only: other threads go on running steps while it captures
    (CUDA's ``thread_local`` capture mode). Outside, a capture forbids them process-wide,
    which catches a helper thread's unsafe call in the graph it helps to record."""
    before = getattr(_capture_thread, "isolated", False)
    _capture_thread.isolated = True
    try:
        yield
    finally:
        _capture_thread.isolated = before


def capture_is_isolated() -> bool:
    """True inside ``isolated_capture()`` on this thread."""
    return getattr(_capture_thread, "isolated", False)


@contextlib.contextmanager
def paused_collection(device_module: ModuleType) -> Iterator[None]:
    """Pauses the garbage collector and ``device_module.empty_cache`` inside the block.

    Releasing cached blocks while a stream is being captured is illegal, and a collection
    can run finalizers that do exactly that; so neither may run during a capture.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    empty_cache = device_module.empty_cache
    device_module.empty_cache = _no_op
    try:
        yield
    finally:
        device_module.empty_cache = empty_cache
        if was_enabled:
            gc.enable()


def _no_op() -> None:
    return None
