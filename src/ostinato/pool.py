"""The shared graph memory pool and the accounting of what captures cost."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from ostinato.batch import BatchDescriptor
from ostinato.modes import GraphMode
from ostinato.platform import Platform, current_platform

_shared_pools: weakref.WeakKeyDictionary[Platform, Any] = weakref.WeakKeyDictionary()


def shared_pool(platform: Platform | None = None) -> Any:
    """The process-wide graph pool of ``platform`` (default: current; None on CPU).

    Every graph captured into it may reuse the memory of every other: only one graph
    replays at a time, so their intermediates never need to coexist. The same platform
    always gets the same pool.
    """
    platform = platform or current_platform()
    if platform not in _shared_pools:
        _shared_pools[platform] = platform.graph_pool_handle()
    return _shared_pools[platform]


@dataclass(frozen=True)
class GraphRecord:
    """One captured graph: its key, runtime mode, cost in memory and capture time.

    ``pool_bytes`` is the growth of the allocator's reserved memory during the capture;
    ``device_bytes`` the growth of device memory in use as the driver sees it (which also
    counts the graph's own executable). Either can be 0 when the pool had room.
    """

    descriptor: BatchDescriptor
    mode: GraphMode
    pool_bytes: int
    device_bytes: int
    seconds: float


@dataclass
class CaptureReport:
    """Everything captured by one start-up, with totals."""

    records: list[GraphRecord] = field(default_factory=list)

    @property
    def num_graphs(self) -> int:
        """Graphs recorded."""
        return len(self.records)

    @property
    def pool_bytes(self) -> int:
        """Total pool growth over all captures."""
        return sum(r.pool_bytes for r in self.records)

    @property
    def device_bytes(self) -> int:
        """Total device-memory growth over all captures."""
        return sum(r.device_bytes for r in self.records)

    @property
    def seconds(self) -> float:
        """Total capture time."""
        return sum(r.seconds for r in self.records)

    def summary(self) -> str:
        """One line: graph count, memory and time."""
        return (
            f"{self.num_graphs} graphs captured in {self.seconds:.2f} s; "
            f"graph memory {self.pool_bytes / 2**20:.1f} MiB in the pool, "
            f"{self.device_bytes / 2**20:.1f} MiB on the device"
        )


class CaptureMeter:
    """Measures one capture: ``with meter.measure(descriptor, mode): ...``.

    Synchronizes the device before reading the counters so queued work is counted.
    """

    def __init__(self, report: CaptureReport, platform: Platform | None = None) -> None:
        self.report = report
        self.platform = platform or current_platform()

    def measure(self, descriptor: BatchDescriptor, mode: GraphMode) -> _Measurement:
        """A context that records one capture of ``descriptor`` into the report."""
        return _Measurement(self, descriptor, mode)


class _Measurement:
    def __init__(self, meter: CaptureMeter, descriptor: BatchDescriptor, mode: GraphMode) -> None:
        self.meter, self.descriptor, self.mode = meter, descriptor, mode

    def __enter__(self) -> None:
        p = self.meter.platform
        p.synchronize()
        self.reserved, self.used = p.memory_reserved(), p.device_used_memory()
        self.start = time.perf_counter()

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            return
        p = self.meter.platform
        p.synchronize()
        seconds = time.perf_counter() - self.start
        self.meter.report.records.append(
            GraphRecord(
                self.descriptor,
                self.mode,
                max(0, p.memory_reserved() - self.reserved),
                max(0, p.device_used_memory() - self.used),
                seconds,
            )
        )
