"""GPU tests of memory: the KV cache sized from free memory, a named error when the model
does not fit, and an out-of-memory capture that leaves the process and device usable."""

import gc

import pytest
import torch

from ostinato.engine import LLM, SamplingParams
from ostinato.engine.worker.memory import EngineMemoryError
from ostinato.errors import GraphCaptureError
from ostinato.platform.cuda import CudaPlatform
from ostinato.pool import release_shared_pool

pytestmark = pytest.mark.gpu
MiB = 2**20


@pytest.fixture(autouse=True)
def fresh_pool():
    # These tests read a capture's pool growth and starve a capture of memory: they need
    # a graph pool of their own, not the process-wide one that earlier tests filled.
    gc.collect()
    release_shared_pool()
    torch.cuda.empty_cache()


def small(**kw):
    base = dict(max_model_len=128, max_num_seqs=4, max_capture_size=16, progress=False)
    return LLM("tiny", **{"capture": "blocking", **base, **kw})


def hog_all_but(keep_bytes):
    free, _ = torch.cuda.mem_get_info()
    return torch.empty(max(free - keep_bytes, 0), dtype=torch.uint8, device="cuda")


def test_kv_cache_is_sized_from_free_memory_and_capped_at_what_can_be_used():
    llm = small(mode="full")
    plan = llm.memory
    assert plan is not None and plan.num_blocks == llm.engine.cache.num_blocks
    assert plan.num_blocks == 4 * 8 + 1  # every sequence at max_model_len, no more
    # The reserve for graphs is checked against what the capture took, both numbers kept.
    check = llm.graph_memory
    assert check is not None and check.reserved == plan.graphs
    assert check.measured == llm.capture_report.pool_bytes > 0
    assert not check.over, check.summary()
    assert "MiB were reserved" in llm.describe()
    torch.cuda.empty_cache()
    hog = []
    try:
        hog.append(hog_all_but(512 * MiB))
        # llama-1.5b needs ~3 GiB of weights: refused before anything is allocated.
        before = torch.cuda.memory_allocated()
        with pytest.raises(EngineMemoryError) as info:
            LLM("llama-1.5b", max_model_len=128, gpu_memory_utilization=1.0, progress=False)
        assert torch.cuda.memory_allocated() == before
        message = str(info.value)
        for part in (
            "MiB of weights",
            "MiB of KV cache",
            "for graphs and activations",
            "gpu_memory_utilization",
            "Lower max_model_len",
        ):
            assert part in message, message
    finally:
        hog.clear()
        torch.cuda.empty_cache()


def test_out_of_memory_during_capture_is_named_and_everything_recovers(monkeypatch):
    real_capture = CudaPlatform.capture
    hog = []
    total = torch.cuda.get_device_properties(0).total_memory

    def starved_capture(self, graph, pool):
        if not hog:  # take every free byte just before the first capture begins
            torch.cuda.empty_cache()
            hog.append(hog_all_but(2 * MiB))
            # Blocks cached in the graph pools of engines that earlier tests left to the
            # garbage collector are not free now but are given back when an allocation
            # fails, and could then serve the capture: cap the allocator as well.
            cap = torch.cuda.memory_allocated() + 2 * MiB
            torch.cuda.set_per_process_memory_fraction(cap / total)
        return real_capture(self, graph, pool)

    # Weights and KV cache fit; one graph of 8192 tokens needs more pool than is left.
    monkeypatch.setattr(CudaPlatform, "capture", starved_capture)
    try:
        with pytest.raises(GraphCaptureError, match="ran out of device memory") as info:
            small(
                mode="full",
                capture_sizes=(8192,),
                max_capture_size=None,  # (the sizes named: no ladder's top beside them)
                max_num_batched_tokens=8192,
            )
        assert "Underlying error: OutOfMemoryError" in str(info.value)
        del info
    finally:
        monkeypatch.setattr(CudaPlatform, "capture", real_capture)
        torch.cuda.set_per_process_memory_fraction(1.0)
        hog.clear()
        torch.cuda.empty_cache()
    eager = small(mode="none")
    (a,) = eager.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))
    graphed = small(mode="full", max_capture_size=8)
    assert graphed.capture_report.num_graphs > 0
    (b,) = graphed.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert a.token_ids == b.token_ids


def test_capture_error_leads_with_the_cause():
    from ostinato import BatchDescriptor, GraphMode, GraphWrapper, capture_phase, forward_context

    x = torch.ones(4, device="cuda")

    def bad():
        y = x * 2
        if y.sum().item() > 0:  # a host sync: cannot be captured
            return y
        return -y

    wrapper = GraphWrapper(bad, GraphMode.FULL)
    d = BatchDescriptor(4)
    with (
        capture_phase(),
        forward_context(GraphMode.FULL, d),
        pytest.raises(GraphCaptureError) as info,
    ):
        wrapper()
    first = str(info.value).splitlines()[0]
    assert first.startswith("capturing ") and "test_gpu_memory.py" in first
    assert "y.sum().item()" in first and "waits for the device" in first
    assert "operation not permitted" not in first
