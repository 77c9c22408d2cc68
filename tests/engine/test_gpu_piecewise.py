"""GPU tests of piecewise graphs: PIECEWISE and FULL_AND_PIECEWISE vs eager in the engine."""

import gc

import pytest
import torch
from collector import walked
from gpu_harness import greedy_tokens, lockstep, tiny_engine

from ostinato.engine import LLM

pytestmark = pytest.mark.gpu


def _engine(mode, dtype, **kw):
    return tiny_engine(mode, dtype, max_capture_size=64, **kw)


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_greedy_tokens_identical_to_eager_fp32(mode):
    eager = _engine("none", torch.float32)
    graphs = _engine(mode, torch.float32)
    assert graphs.mode.name == mode.upper()
    assert (
        graphs.engine.runner.piecewise is not None
        and graphs.engine.runner.piecewise.stats.compiles == 1
    )
    assert greedy_tokens(graphs) == greedy_tokens(eager)
    assert graphs.engine.runner.piecewise.stats.compiles == 1, "one compilation for every size"
    assert graphs.engine.runner.piecewise.num_graphs > 0


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_logits_match_eager_bf16_random_mixes(mode):
    eager = _engine("none", torch.bfloat16)
    graphs = _engine(mode, torch.bfloat16)
    modes_seen = lockstep(eager, graphs, tolerance=2e-2)
    expected = {"PIECEWISE"} if mode == "piecewise" else {"PIECEWISE", "FULL"}
    assert expected <= modes_seen, modes_seen


def test_the_default_engine_captures_full_graphs_in_the_background_then_sampling_graphs():
    # "auto" on CUDA with attention that can be captured whole: FULL graphs, nothing
    # compiled, captured on a thread while steps run (measured sooner to the first
    # answer: benchmarks/RESULTS.md); the sampling graphs come last, on the same thread.
    # float32: tokens equal a blocking capture's before, during and after.
    from ostinato.background import BackgroundCapture
    from ostinato.engine import SamplingParams

    kw = dict(max_model_len=128, max_num_seqs=4, max_capture_size=16, progress=False, seed=3)
    blocking = LLM("tiny", dtype=torch.float32, capture="blocking", **kw)
    # The sizes captured, not the count: a start that measures the kernel plans captures
    # the sizes whose plans changed again, and its report keeps both captures. Whether a
    # start measures them depends on the plan cache (the blocking start, first in a test
    # session, measured them; this one, after it, captured each size once on an H100).
    want = greedy_tokens(blocking, 12)
    graphs = {r.descriptor for r in blocking.capture_report.records}
    blocking.close()
    llm = LLM("tiny", dtype=torch.float32, **kw)
    assert llm.mode.name == "FULL" and llm.engine.runner.compile_seconds == 0
    assert isinstance(llm.background, BackgroundCapture)
    assert greedy_tokens(llm, 12) == want  # eager or replayed, as the capture proceeds
    assert llm.wait_for_graphs(120), llm.background.summary()
    assert {r.descriptor for r in llm.capture_report.records} == graphs
    assert {r.mode.name for r in llm.capture_report.records} == {"FULL"}
    sampler = llm.engine.sampler.graph_sampler
    assert sampler is not None  # captured after the step graphs
    assert greedy_tokens(llm, 12) == want
    calls = []
    inner = sampler.sample
    sampler.sample = lambda *a: calls.append(inner(*a)) or calls[-1]
    params = SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True)
    llm.generate([[5, 6, 7], [8, 9]], params)
    assert any(c is not None for c in calls)  # sampled decode steps replayed the graphs
    assert "graphs: background" not in llm.describe()
    llm.close()


@pytest.mark.parametrize("timing", ["measured", "upgrade faster"])
def test_a_staged_start_gives_full_graphs_tokens_before_during_and_after_its_upgrade(
    timing, monkeypatch
):
    # float32: FULL graphs of the eager model first (nothing compiled), the compiled
    # FULL_AND_PIECEWISE graphs captured and timed on a thread, each bucket moved where
    # faster (or, "upgrade faster", every bucket: its decode graphs and its pieces both
    # serve steps); the greedy tokens never change, and the graphs of both stages stay
    # within the memory plan.
    from ostinato import staged

    if timing == "upgrade faster":
        real = staged.wall_timer

        def timer(runtime, dispatch, rows, meta):
            seconds = real(runtime, dispatch, rows, meta)
            return seconds if runtime.mode.name == "FULL" else 0.0  # (the first stage's)

        monkeypatch.setattr(staged, "wall_timer", timer)
    want = greedy_tokens(_engine("full", torch.float32))
    torch.cuda.reset_peak_memory_stats()
    llm = _engine("auto", torch.float32, capture="staged")
    assert llm.mode.name == "FULL" and llm.engine.runner.compile_seconds == 0
    during = greedy_tokens(llm)  # steps run while the upgrade compiles and captures
    assert llm.wait_for_graphs(timeout=300), llm.background.summary()
    upgrade = llm.background
    assert upgrade.error is None, upgrade.summary()
    assert {d.uniform_decode for d in upgrade.decisions} == {True, False}  # both kinds timed
    if timing == "upgrade faster":
        assert upgrade.upgraded == set(upgrade.decisions)
        # What the upgrade's thread made lives as long as its graphs: frozen before
        # wait_for_graphs returned (heap.freeze_heap), no later full collection walks it.
        assert not walked([upgrade.upgrade, upgrade.upgrade.manager]) and gc.isenabled()
    print(upgrade.summary(), sorted((d.num_tokens, d.uniform_decode) for d in upgrade.upgraded))
    assert during == want and greedy_tokens(llm) == want
    assert torch.cuda.max_memory_reserved() <= llm.memory.budget, llm.memory.summary()
    llm.close()
