"""The Ascend NPU platform, through ``torch_npu``. Importing this module needs torch_npu.

Not run on Ascend hardware here: no NPU was available to this project. The capture,
replay and parameter-update calls follow torch_npu's graph task API as vLLM-Ascend uses
it; the CPU tests check the protocol against a fake torch_npu (tests/fake_torch_npu.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ostinato import steps_first
from ostinato.errors import PlatformError
from ostinato.param_updates import UpdatableTask, UpdateOrder
from ostinato.platform.base import Graph, Platform, exclusive_device, paused_collection

try:
    import torch_npu  # noqa: F401  (registers torch.npu)
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise PlatformError(
        "the npu platform needs torch_npu (pip install torch-npu matching your torch "
        "and CANN versions); on other machines use the cuda or cpu platform"
    ) from exc


class NpuPlatform(Platform):
    """ACL graphs through ``torch.npu.NPUGraph``, with attention parameters updated inside
    captured graphs (``ostinato.param_updates``).

    An updatable op is captured as a task group (``graph_task_group_begin``/``end``) after
    waiting on, and resetting, an external event of its own. Before it runs in a replay,
    the op is issued again with the step's parameters between ``graph_task_update_begin``
    and ``graph_task_update_end`` on a side stream, which then records the event.
    ``update_order`` says how step i's updates are kept off step i-1's replay:
    ``SYNC_THEN_UPDATE`` (the default) synchronizes the device before updating and then
    replays; ``REPLAY_THEN_UPDATE`` launches the replay first and makes the update
    stream wait for an event taken before the launch, with no host synchronize.
    """

    name = "npu"
    device_type = "npu"
    supports_graphs = True

    def __init__(self, update_order: UpdateOrder = UpdateOrder.SYNC_THEN_UPDATE) -> None:
        if update_order is UpdateOrder.NONE:
            raise ValueError(
                "update_order: Ascend's attention ops take host parameters, so the npu "
                "platform must update them; use SYNC_THEN_UPDATE or REPLAY_THEN_UPDATE"
            )
        self.update_order = update_order
        self._update_stream: Any = None

    @property  # type: ignore[override]
    def sync_before_replay(self) -> bool:
        return self.update_order is UpdateOrder.SYNC_THEN_UPDATE

    def new_graph(self) -> Graph:
        return torch.npu.NPUGraph()

    def graph_pool_handle(self) -> Any:
        return torch.npu.graph_pool_handle()

    @contextlib.contextmanager
    def capture(self, graph: Graph, pool: Any) -> Iterator[None]:
        with exclusive_device(), paused_collection(torch.npu), steps_first.unpaused():
            with torch.npu.graph(graph, pool=pool):
                yield

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def memory_reserved(self) -> int:
        return torch.npu.memory_reserved()

    def device_used_memory(self) -> int:
        free, total = torch.npu.mem_get_info()
        return total - free

    def device_memory(self) -> tuple[int, int] | None:
        free, total = torch.npu.mem_get_info()
        return free, total

    def empty_cache(self) -> None:
        torch.npu.empty_cache()

    def capture_task(self, issue: Callable[[], None]) -> tuple[Any, Any]:
        stream = torch.npu.current_stream()
        event = torch.npu.ExternalEvent()
        event.wait(stream)  # captured: the task waits for its update's record
        event.reset(stream)  # ... and re-arms the event for the next replay
        torch.npu.graph_task_group_begin(stream)
        try:
            issue()
        finally:
            handle = torch.npu.graph_task_group_end(stream)
        return handle, event

    def update_tasks(self, tasks: Sequence[UpdatableTask], step: Any, fence: Any = None) -> None:
        if self._update_stream is None:
            self._update_stream = torch.npu.Stream()
        stream = self._update_stream
        with torch.npu.stream(stream):
            if fence is not None:
                stream.wait_event(fence)
            for task in tasks:
                torch.npu.graph_task_update_begin(stream, task.handle)
                task.reissue(step)
                torch.npu.graph_task_update_end(stream)
                task.event.record(stream)

    def replay_fence(self) -> Any:
        event = torch.npu.Event()
        event.record(torch.npu.current_stream())
        return event
