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
        # Pools retired after a failed capture, and the pool that replaces each.
        self._pool_replacements: dict[Any, Any] = {}

    def new_graph(self) -> Graph:
        return torch.cuda.CUDAGraph()

    def graph_pool_handle(self) -> Any:
        return torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def capture(self, graph: Graph, pool: Any) -> Iterator[None]:
        """Records into ``graph`` on the platform's capture stream, into ``pool``.

        A failed capture leaves the device usable: the RNG is reset, and ``pool`` is
        retired (PyTorch refuses to capture into a pool after a failed capture in it),
        so later captures asked for ``pool`` go to a fresh pool. The failed pool's
        memory stays reserved until the process ends.
        """
        # Capture needs a non-default stream; one stream serves every capture so that
        # graphs sharing a pool are recorded in order.
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        assert isinstance(graph, torch.cuda.CUDAGraph)
        # Name the pool even when none was given: recovery needs its id, and a graph
        # cannot report it after failing.
        requested = pool if pool is not None else torch.cuda.graph_pool_handle()
        pool = self._pool_replacements.get(requested, requested)
        with paused_collection(torch.cuda), torch.cuda.stream(self._capture_stream):
            try:
                graph.capture_begin(pool=pool)
            except Exception:
                self._reset_rng_capture_state()
                raise
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
                    self._recover_from_failed_capture(requested, pool)
                    # After a failed body, ending the invalid capture raises a second,
                    # vaguer error ("failed due to a previous error"); keep the first.
                    if not body_failed:
                        raise

    def _recover_from_failed_capture(self, requested: Any, pool: Any) -> None:
        # A capture_end that fails stops early: the allocator still routes this
        # capture's allocations into the pool, and the RNG generator stays marked as
        # capturing (every later random op fails: "Offset increment outside graph
        # capture"). Even with routing ended, PyTorch (2.11) refuses further captures
        # into that pool ("already recording to mempool_id"), so it is replaced.
        with contextlib.suppress(Exception):
            torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
        self._pool_replacements[requested] = torch.cuda.graph_pool_handle()
        self._reset_rng_capture_state()

    def _reset_rng_capture_state(self) -> None:
        # A throwaway capture that ends cleanly clears the generator's capture mark.
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
