"""GPU tests of start-up on the real model (SmolLM2-135M-Instruct, GGUF, float32): the
model cache changes no output, and background capture gives the greedy tokens of a
blocking capture while its steps run before, during and after the capture."""

import gc

import pytest
import torch
from smollm2 import PROMPTS, QUESTION, gguf_path

import ostinato.engine.loading.source as source_module
from ostinato.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
PARAMS = SamplingParams(max_tokens=32)


def engine(**kw):
    gguf_path()
    base = dict(max_model_len=512, max_num_seqs=8, max_capture_size=64, progress=False)
    return LLM(**{**base, "capture": "blocking", **kw})


def prompts(llm):
    return [llm.tokenizer.encode(p) for p in PROMPTS] + [llm.chat_prompt(QUESTION)]


def greedy(llm, ps):
    return [o.token_ids for o in llm.generate(ps, PARAMS)]


def closed(llm):
    llm.close()
    gc.collect()
    torch.cuda.empty_cache()


def test_the_model_cache_changes_no_output(tmp_path, monkeypatch):
    converted = engine(mode="full", cache_dir=tmp_path)  # a miss: converts and stores
    ps = prompts(converted)
    want = greedy(converted, ps)
    closed(converted)

    def no_parsing(*args, **kwargs):
        raise AssertionError("a cache hit parsed the GGUF file")

    with monkeypatch.context() as m:
        m.setattr(source_module, "GGUFCheckpoint", no_parsing)
        cached = engine(mode="full", cache_dir=tmp_path)
        assert prompts(cached) == ps and greedy(cached, ps) == want
        closed(cached)
    uncached = engine(mode="full", cache_dir=False)
    assert greedy(uncached, ps) == want
    closed(uncached)


@pytest.mark.parametrize("mode", ["full", "full_and_piecewise"])
def test_background_capture_gives_the_tokens_of_a_blocking_capture(mode):
    blocking = engine(mode=mode)
    ps = prompts(blocking)
    want = greedy(blocking, ps)
    graphs = blocking.capture_report.num_graphs
    closed(blocking)

    torch.cuda.reset_peak_memory_stats()
    llm = engine(mode=mode, capture="background")
    started_before_ready = not llm.background.done
    first = greedy(llm, ps)  # steps run eagerly or replay, as the capture proceeds
    assert llm.wait_for_graphs(timeout=300), llm.background.summary()
    assert llm.capture_report.num_graphs == graphs
    assert first == want
    assert greedy(llm, ps) == want  # every size replayed now
    # The memory plan reserved the graphs' memory before serving started.
    assert torch.cuda.max_memory_reserved() <= llm.memory.budget, llm.memory.summary()
    print(mode, "steps began before the graphs were ready:", started_before_ready)
    if mode == "full_and_piecewise":  # Inductor compiles on the thread: seconds
        assert started_before_ready
    closed(llm)


def test_a_failed_background_capture_leaves_the_engine_serving(monkeypatch):
    import ostinato.manager as manager_module
    from ostinato.errors import GraphCaptureError

    blocking = engine(mode="none")
    ps = prompts(blocking)
    want = greedy(blocking, ps)
    closed(blocking)

    def fail(self, item):
        raise GraphCaptureError(f"injected failure capturing {item.descriptor}")

    monkeypatch.setattr(manager_module.GraphManager, "_capture_one", fail)
    llm = engine(mode="full", capture="background")
    assert not llm.wait_for_graphs(timeout=120)
    assert "injected failure" in llm.background.summary()
    assert llm.capture_report.num_graphs == 0 or llm.engine.runner.manager.num_graphs == 0
    assert greedy(llm, ps) == want  # eager, and right
    closed(llm)
