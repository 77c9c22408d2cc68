"""GPU tests of start-up on the real model (SmolLM2-135M-Instruct, GGUF, float32): the
model cache changes no output, and background capture gives the greedy tokens of a
blocking capture while its steps run before, during and after the capture."""

import gc

import pytest
import torch
from smollm2 import PROMPTS, QUESTION, gguf_path

import ostinato.engine.loading.source as source_module
from ostinato.engine import LLM, SamplingParams
from ostinato.engine.kernels.gemm_launch import MAX_ROWS
from ostinato.modes import GraphMode

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
    # (the sizes captured: a start whose measured plans changed kernels captures some again)
    graphs = {r.descriptor for r in blocking.capture_report.records}
    closed(blocking)

    torch.cuda.reset_peak_memory_stats()
    llm = engine(mode=mode, capture="background")
    started_before_ready = not llm.background.done
    first = greedy(llm, ps)  # steps run eagerly or replay, as the capture proceeds
    assert llm.wait_for_graphs(timeout=300), llm.background.summary()
    assert {r.descriptor for r in llm.capture_report.records} == graphs
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

    def fail(self, item, apart):
        raise GraphCaptureError(f"injected failure capturing {item.descriptor}")

    monkeypatch.setattr(manager_module.GraphManager, "_capture_one", fail)
    llm = engine(mode="full", capture="background")
    assert not llm.wait_for_graphs(timeout=120)
    assert "injected failure" in llm.background.summary()
    assert llm.capture_report.num_graphs == 0 or llm.engine.runner.manager.num_graphs == 0
    assert greedy(llm, ps) == want  # eager, and right
    closed(llm)


def test_deferred_kernel_plans_give_the_tokens_of_plans_measured_first(tmp_path):
    # Every cache empty: the start serves on the rules' layer plan (fused at every size)
    # and measures the real one after its graphs, on their thread. float32: the tokens
    # before, during and after equal those of a start that measured first.
    blocking = engine(mode="full", cache_dir=tmp_path / "blocking")
    ps = prompts(blocking)
    want = greedy(blocking, ps)
    closed(blocking)

    llm = engine(mode="full", capture="auto", cache_dir=tmp_path / "deferred")
    assert llm.engine.parts.startup.plans_deferred and llm.background is not None
    first = greedy(llm, ps)
    assert llm.wait_for_graphs(timeout=300), llm.background.summary()
    assert llm.background.afterwards_error is None, llm.background.summary()
    runner = llm.engine.runner
    assert runner.kernel_plan.layer_timings  # measured, after the graphs
    # Captured again: the sizes whose kernels the measurement changed (GEMM plans, fused
    # layers, PDL), all within the rows where plans apply.
    recaptured = {d.num_tokens for d in runner.deferred_plans.recaptured}
    assert all(rows <= MAX_ROWS for rows in recaptured), recaptured
    assert first == want and greedy(llm, ps) == want
    print(llm.describe())
    closed(llm)
    again = engine(mode="full", capture="auto", cache_dir=tmp_path / "deferred")
    assert not again.engine.parts.startup.plans_deferred  # stored by the first
    closed(again)


@pytest.mark.parametrize("new_wins", [True, False])
def test_measured_gemm_plans_recaptured_run_as_a_start_that_read_them(
    tmp_path, monkeypatch, new_wins
):
    # bf16 with random weights: the small-GEMM plans are measured after the graphs too,
    # and the projections get new plans (and new split-K counters) while the rules'
    # graphs still replay. Every recaptured graph kept, or every rules' graph kept (the
    # plans then take the rules' kernels back at those sizes, in the cache too): the
    # tokens equal, bit for bit, those of a start that read the plans from the cache.
    import ostinato.engine.worker.deferred_plans as deferred_module

    monkeypatch.setattr(deferred_module, "faster_replay", lambda sync: lambda *graphs: new_wins)
    kw = dict(model="tiny", dtype=torch.bfloat16, max_model_len=256, max_num_seqs=8)
    kw |= dict(max_capture_size=32, progress=False, cache_dir=tmp_path, seed=1)
    ps = [[(13 * i + 7 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(8)]
    llm = LLM(mode="full", capture="auto", **kw)
    assert llm.engine.parts.startup.plans_deferred
    during = greedy(llm, ps)
    assert llm.wait_for_graphs(timeout=300), llm.background.summary()
    assert llm.background.afterwards_error is None, llm.background.summary()
    runner = llm.engine.runner
    assert runner.kernel_plan.timings, "no GEMM plan measured"
    after = greedy(llm, ps)
    print(llm.describe(), sorted(d.num_tokens for d in runner.deferred_plans.recaptured))
    closed(llm)
    recaptured = runner.deferred_plans.recaptured
    assert recaptured and set(recaptured.values()) == {new_wins}
    read = LLM(mode="full", capture="blocking", **kw)
    assert read.engine.runner.kernel_plan.timings == []  # every plan read, none measured
    assert read.engine.runner.kernel_plan.layer_timings == []
    assert greedy(read, ps) == after
    assert len(during) == len(after)
    closed(read)


def test_graphs_replayed_between_steps_leave_the_tokens_the_next_step_reads(tmp_path):
    # A recapture (the measured plans' swap) times the graph it would replace between two
    # steps. That graph was captured before the sampling graphs, whose outputs (the last
    # step's tokens, which the next step's decodes gather) may lie where its
    # intermediates do in the shared pool: on the 1.5 B shape its replay made the next
    # step's embedding read out of bounds. Here every FULL graph is captured again and
    # both graphs replayed between every two steps; the tokens must not change.
    kw = dict(model="tiny", mode="full", capture="blocking", dtype=torch.float32)
    kw |= dict(max_model_len=256, max_num_seqs=8, max_capture_size=32, progress=False)
    llm = LLM(cache_dir=tmp_path, seed=1, **kw)
    ps = [[(13 * i + 7 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(8)]
    want = greedy(llm, ps)
    manager = llm.engine.runner.manager
    sizes = list(manager.dispatcher.keys(GraphMode.FULL))
    assert llm.engine.loop.sampler.graph_sampler.graphs, "no sampling graph: nothing to check"

    def both(old, new, held):
        old(), new(), old()
        return False

    def recapture_all(index, token):
        if index == 0:  # once a step (the first prompt decodes to the end)
            for d in sizes:
                assert manager.recapture(d, both) is False

    got = [o.token_ids for o in llm.generate(ps, PARAMS, on_token=recapture_all)]
    assert got == want
    closed(llm)
