"""What captures cost: one record per graph (memory, time) and the report of a start-up."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ostinato.batch import BatchDescriptor
from ostinato.modes import GraphMode
from ostinato.platform import Platform, current_platform


@dataclass(frozen=True)
class GraphRecord:
    """One captured graph: its key, runtime mode, cost in memory and capture time.

    ``pool_bytes`` is the growth of the graph pool's own segments during the capture
    (where the platform cannot tell them apart: of all the allocator holds);
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
    def lora_graphs(self) -> int:
        """Graphs recorded for steps with LoRA rows (``BatchDescriptor.has_lora``)."""
        return sum(1 for r in self.records if r.descriptor.has_lora)

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
        """One line: graph count (those with LoRA where any), memory and time."""
        lora = f" ({self.lora_graphs} with LoRA)" if self.lora_graphs else ""
        return (
            f"{self.num_graphs} graphs{lora} captured in {self.seconds:.2f} s; "
            f"graph memory {self.pool_bytes / 2**20:.1f} MiB in the pool, "
            f"{self.device_bytes / 2**20:.1f} MiB on the device"
        )


class CaptureMeter:
    """Measures captures into a ``CaptureReport``: ``with meter.measure(descriptor, mode):``.

    Synchronizes the device before reading the counters so queued work is counted; a
    capture that raises is not recorded.
    """

    def __init__(
        self, report: CaptureReport, platform: Platform | None = None, pool: Any = None
    ) -> None:
        self.report = report
        self.platform = platform or current_platform()
        self.pool = pool  # None: count everything the allocator holds

    @contextlib.contextmanager
    def measure(self, descriptor: BatchDescriptor, mode: GraphMode) -> Iterator[None]:
        """A context that records one capture of ``descriptor`` into the report."""
        p = self.platform
        p.synchronize()
        reserved, used = self._held(), p.device_used_memory()
        start = time.perf_counter()
        yield
        p.synchronize()
        self.report.records.append(
            GraphRecord(
                descriptor,
                mode,
                max(0, self._held() - reserved),
                max(0, p.device_used_memory() - used),
                time.perf_counter() - start,
            )
        )

    def _held(self) -> int:
        p = self.platform
        return p.memory_reserved() if self.pool is None else p.pool_bytes(self.pool)
