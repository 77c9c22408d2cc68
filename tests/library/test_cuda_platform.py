"""The CUDA platform's host-side choices with torch's CUDA calls stood in (its GPU tests:
``test_gpu_core``, ``test_gpu_replay_check``)."""

import threading

import pytest
import torch

from ostinato.platform import cuda

SEGMENTS = [
    {"segment_pool_id": (0, 0), "total_size": 1 << 20},
    {"segment_pool_id": (1, 7), "total_size": 2 << 20},
    {"segment_pool_id": (1, 7), "total_size": 4 << 20},
    {"segment_pool_id": (1, 8), "total_size": 8 << 20},
]


def test_a_pools_bytes_ask_torch_for_that_pool_alone_without_traces(monkeypatch):
    # A whole snapshot of a serving process takes milliseconds, twice per capture: where
    # torch takes a pool and no traces, only that pool's segments are asked for.
    asked = []

    def snapshot(mempool_id=None, include_traces=True):
        asked.append((mempool_id, include_traces))
        return [s for s in SEGMENTS if mempool_id is None or s["segment_pool_id"] == mempool_id]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    assert cuda.CudaPlatform().pool_bytes((1, 7)) == 6 << 20
    assert asked == [((1, 7), False)]


def test_a_torch_that_takes_no_pool_has_its_whole_snapshot_filtered(monkeypatch):
    asked = []

    def snapshot():
        asked.append(None)
        return SEGMENTS

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    monkeypatch.setattr(cuda, "_SNAPSHOT_ASKS", frozenset())
    assert cuda.CudaPlatform().pool_bytes([1, 8]) == 8 << 20 and asked == [None]


def test_cublas_workspaces_are_dropped_around_blocking_captures_until_one_runs_beside_steps(
    monkeypatch,
):
    # Dropped before and after a blocking capture (even one that fails), so its workspace
    # is made in its pool and freed there. Never beside running steps (isolated), where a
    # step thread may be between fetching its workspace and launching its GEMM; and once a
    # capture ran there, never again: its workspace may be read by graphs of other pools.
    from ostinato.platform.base import isolated_capture

    events = []
    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces", lambda: events.append("drop"), raising=False
    )
    monkeypatch.setattr(cuda, "_KEPT_WORKSPACES", threading.Event())  # (a fresh process)
    with cuda.cublas_workspaces_in_capture():
        events.append("capture")
    assert events == ["drop", "capture", "drop"]
    events.clear()
    with pytest.raises(RuntimeError), cuda.cublas_workspaces_in_capture():
        raise RuntimeError("the capture failed")
    assert events == ["drop", "drop"]
    events.clear()
    with isolated_capture(), cuda.cublas_workspaces_in_capture():
        events.append("beside steps")
    with cuda.cublas_workspaces_in_capture():
        events.append("blocking, after")
    assert events == ["beside steps", "blocking, after"]
