"""The CUDA platform (also ROCm/HIP, which PyTorch exposes through the same API)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ostinato.platform.base import Graph, Platform, paused_collection


class CudaPlatform(Platform):
    """CUDA graphs through ``torch.cuda.CUDAGraph`` on the current device."""

    device_type = "cuda"
    supports_graphs = True

    def __init__(self) -> None:
        self.name = "rocm" if torch.version.hip else "cuda"
        self._capture_stream: torch.cuda.Stream | None = None

    def new_graph(self) -> Graph:
        return torch.cuda.CUDAGraph()

    def graph_pool_handle(self) -> Any:
        return torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def capture(self, graph: Graph, pool: Any) -> Iterator[None]:
        # Capture needs a non-default stream; one stream serves every capture so that
        # graphs sharing a pool are recorded in order.
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        assert isinstance(graph, torch.cuda.CUDAGraph)
        # Name the pool even when none was given: recovery from a failed capture needs
        # its id, and a graph cannot report it after failing.
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with paused_collection(torch.cuda), torch.cuda.stream(self._capture_stream):
            graph.capture_begin(pool=pool)
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
                    self._recover_from_failed_capture_end(pool)
                    # After a failed body, ending the invalid capture raises a second,
                    # vaguer error ("failed due to a previous error"); keep the first.
                    if not body_failed:
                        raise

    def _recover_from_failed_capture_end(self, pool: Any) -> None:
        # A capture_end that fails stops early, leaving two pieces of state behind:
        # the allocator still routes this thread's allocations into the graph's pool
        # (the next capture into it fails: "already recording to mempool_id"), and the
        # RNG generator stays marked as capturing (every later random op fails: "Offset
        # increment outside graph capture"). Undo the first directly; a throwaway capture
        # that ends cleanly resets the second.
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
        scratch = torch.cuda.CUDAGraph()
        scratch.capture_begin()
        torch.empty(1, device="cuda").zero_()
        scratch.capture_end()
        scratch.reset()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved()

    def device_used_memory(self) -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    @contextlib.contextmanager
    def sync_errors(self) -> Iterator[None]:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
