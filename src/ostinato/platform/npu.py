"""The Ascend NPU platform, through ``torch_npu``. Importing this module needs torch_npu."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ostinato.errors import PlatformError
from ostinato.platform.base import Graph, Platform, paused_collection

try:
    import torch_npu  # noqa: F401  (registers torch.npu)
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise PlatformError(
        "the npu platform needs torch_npu (pip install torch-npu matching your torch "
        "and CANN versions); on other machines use the cuda or cpu platform"
    ) from exc


class NpuPlatform(Platform):
    """ACL graphs through ``torch.npu.NPUGraph``.

    Replays are preceded by a device synchronize: attention-parameter updates recorded
    on a side stream for step i must not overtake the replay of step i-1.
    """

    name = "npu"
    device_type = "npu"
    supports_graphs = True
    sync_before_replay = True

    def new_graph(self) -> Graph:
        return torch.npu.NPUGraph()

    def graph_pool_handle(self) -> Any:
        return torch.npu.graph_pool_handle()

    @contextlib.contextmanager
    def capture(self, graph: Graph, pool: Any) -> Iterator[None]:
        with paused_collection(torch.npu), torch.npu.graph(graph, pool=pool):
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
