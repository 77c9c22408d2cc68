"""The CPU platform: no graphs; every step runs eagerly through the same code above."""

from __future__ import annotations

import contextlib
from typing import Any, NoReturn

from ostinato.errors import PlatformError
from ostinato.platform.base import Graph, Platform


class CpuPlatform(Platform):
    """No graph support: dispatchers resolve every mode to NONE on this platform."""

    name = "cpu"
    device_type = "cpu"
    supports_graphs = False

    def _no_graphs(self) -> NoReturn:
        raise PlatformError(
            "the cpu platform cannot capture graphs; resolve the mode with "
            "resolution.resolve_mode(..., platform_has_graphs=False) so steps run as NONE"
        )

    def new_graph(self) -> Graph:
        self._no_graphs()

    def graph_pool_handle(self) -> Any:
        return None

    def capture(self, graph: Graph, pool: Any) -> contextlib.AbstractContextManager[None]:
        self._no_graphs()
