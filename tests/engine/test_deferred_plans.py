"""Kernel plans deferred past the graphs (``KernelPlan.plan(defer=True)``): a background
start whose plans are not cached runs the rules' plans, measures the real ones once its
graphs serve, stores them, and captures again the sizes whose kernels they change,
keeping the faster graph. On the CPU, with the test double for graphs and timings of
our own (the GPU's are ``graph_call_us``); the GPU test is in ``test_gpu_startup``."""

import contextlib
import time

import pytest
import torch
from fakes import FakePlatform
from test_graphed_engine import engine

from ostinato.engine import KernelOptions, SamplingParams
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.model.linear import Linear
from ostinato.engine.model.presets import shape
from ostinato.engine.worker import kernel_plan as kernel_plan_module
from ostinato.engine.worker import runner as runner_module
from ostinato.engine.worker.compile_cache import CompileCache
from ostinato.engine.worker.inputs import StepInputs
from ostinato.engine.worker.kernel_plan import KernelPlan
from ostinato.engine.worker.runner import ModelRunner
from ostinato.modes import GraphMode

LIMITS = EngineLimits(4, 64, 64, 16)


def _plan(cache, timer, rows=(1, 2, 4), small_gemm_rows=(), padding=None):
    model = DecoderModel(ModelConfig.from_hf(shape("tiny")), kernels=KernelOptions())
    # (the model holds the options left unset on: as a Hopper GPU resolves them)
    return KernelPlan(model, model.kernels, LIMITS, small_gemm_rows, cache, padding, timer, rows)


def _timer(calls, faster_unfused=(2,), faster_without_pdl=()):
    def timer(rows, unfused, pdl):
        calls.append((rows, unfused))
        us = 50.0 if unfused and rows in faster_unfused else 100.0
        if not pdl:
            return us / 2 if rows in faster_without_pdl else us * 2
        return us

    return timer


def test_a_start_without_cached_plans_runs_the_rules_and_measures_them_later(tmp_path, cpu_keys):
    cache, calls = CompileCache(tmp_path), []
    kp = _plan(cache, _timer(calls))
    assert kp.plan(defer=True) == [] and kp.deferred and kp.ahead  # compiles the rules'
    assert calls == [] and kp.model.unfused_rows == frozenset()
    turns = []

    @contextlib.contextmanager
    def turn():
        turns.append(1)
        yield

    changed = kp.measure_deferred(_timer(calls, faster_without_pdl=(1,)), turn)
    assert changed == frozenset({1, 2}) and kp.model.unfused_rows == frozenset({2})
    assert kp.model.no_pdl_rows == frozenset({1})  # (a size whose PDL alone changed)
    assert not kp.deferred and len(calls) == 12
    with pytest.raises(RuntimeError, match="not deferred"):
        kp.measure_deferred(_timer(calls), turn)
    # The next start finds the plan: nothing deferred, nothing timed.
    again = _plan(cache, _timer(calls))
    again.plan(defer=True)
    assert not again.deferred and again.model.unfused_rows == frozenset({2}) and len(calls) == 12
    assert again.model.no_pdl_rows == frozenset({1})
    # Without defer (a blocking start, compiled pieces) the plan is measured first.
    first = _plan(CompileCache(tmp_path / "other"), _timer(calls))
    first.plan()
    assert not first.deferred and first.model.unfused_rows == frozenset({2}) and len(calls) == 24


def test_the_compile_workers_start_with_the_plan_only_where_the_kernels_compile_ahead(
    tmp_path, cpu_keys, monkeypatch
):
    started = []
    monkeypatch.setattr(kernel_plan_module, "start_workers", lambda: started.append(1))
    cache, calls = CompileCache(tmp_path), []
    first = _plan(cache, _timer(calls))
    first.plan(defer=True)
    assert first.ahead and started == [1]  # deferred: the rules' kernels compile next
    first.measure_deferred(_timer(calls), contextlib.nullcontext)
    again = _plan(cache, _timer(calls))
    again.plan(defer=True)  # the plans read back: an earlier start compiled the kernels
    assert not again.ahead and started == [1]


def test_plans_that_change_kernels_compile_them_ahead_before_the_graphs_are_captured_again(
    tmp_path, cpu_keys, monkeypatch
):
    # The graphs captured again launch the measured plans' kernels, which the first
    # compile-ahead (on the rules' plans) never saw: a launch's compile held the step turn
    # (a blocking start: its own). So where a plan changed, every row count to 16 is
    # passed again, as a decode graph and as a mixed step run it; nowhere else.
    from ostinato.engine.kernels.gemm_launch import MAX_ROWS

    inside, passes = [], []

    @contextlib.contextmanager
    def recording_ahead():
        inside.append(True)
        yield
        inside.clear()

    def recorded(kind, width):
        def call(self, input_ids, positions):
            if inside:
                passes.append((kind, input_ids.shape[0]))
            return torch.zeros(input_ids.shape[0], width(self.config))

        return call

    monkeypatch.setattr(kernel_plan_module, "compile_ahead", recording_ahead)
    monkeypatch.setattr(DecoderModel, "forward", recorded("mixed", lambda c: c.hidden_size))
    monkeypatch.setattr(DecoderModel, "logits", recorded("decode", lambda c: c.vocab_size))
    padding = lambda inputs, n: contextlib.nullcontext()  # noqa: E731
    kp = _plan(CompileCache(tmp_path), _timer([]), padding=padding)
    assert kp.plan(defer=True) == [] and kp.ahead
    changed = kp.measure_deferred(_timer([]), contextlib.nullcontext)
    inputs = StepInputs(LIMITS, torch.device("cpu"))
    kp.compile_measured(inputs, frozenset())
    assert changed and passes == []
    kp.compile_measured(inputs, changed)
    small = set(range(1, MAX_ROWS + 1))
    assert {n for kind, n in passes if kind == "decode"} == small
    assert {n for kind, n in passes if kind == "mixed"} == small
    kp.ahead = False  # (compile_ahead off, or plans read from the cache: nothing)
    passes.clear()
    kp.compile_measured(inputs, changed)
    assert passes == []


def test_measured_gemm_plans_name_the_rows_they_change_and_the_rules_counters_live_on(
    tmp_path, cpu_keys, monkeypatch
):
    # On the CPU no projection gets a GEMM plan: stand in for the GPU's measurement.
    monkeypatch.setattr(kernel_plan_module, "small_gemm_plans_cached", lambda *a, **k: False)
    kp = _plan(CompileCache(tmp_path), _timer([], faster_unfused=()), small_gemm_rows=(1, 2))
    qkv = kp.model.layers[0].self_attn.qkv_proj
    qkv.use_plan((0, 3, 3), 4, False)  # as a rule would give it
    counters = qkv.counters
    assert kp.plan(defer=True) == [] and kp.deferred

    def measured(linears, rows, pdl, cache=None, turn=None):
        with turn():
            qkv.use_plan((0, 3, 0), 4, False)  # cuBLAS measured faster at two rows
        return []

    monkeypatch.setattr(kernel_plan_module, "plan_small_gemms", measured)
    assert kp.measure_deferred(None, contextlib.nullcontext) == frozenset({2})
    assert any(t is counters for t in kp._retired) and qkv.counters is not counters
    # The rules' graph replayed faster at two rows: the rules' entry there again, and the
    # measured plan's counters alive for the graphs captured with them.
    measured_counters = qkv.counters
    kp.keep_rules_at(frozenset({2}), contextlib.nullcontext)
    assert qkv.plan == (0, 3, 3) and qkv.counters is not measured_counters
    assert any(t is measured_counters for t in kp._retired)
    kp.keep_rules_at(frozenset({1}), contextlib.nullcontext)  # the same entry: untouched
    assert qkv.plan == (0, 3, 3) and not any(t is qkv.counters for t in kp._retired)
    # A projection the rules left to cuBLAS (no plan, PDL off) whose measured plan runs
    # Triton with PDL: the rules' entry where they won, the measured entries elsewhere
    # with the PDL they were measured (and compiled ahead) with.
    head = kp.model.lm_head
    kp._rules[-1] = ((), False)
    head.use_plan((0, 5, 5), 4, True)
    kp.keep_rules_at(frozenset({1}), contextlib.nullcontext)
    assert head.plan == (0, 0, 5) and head.pdl
    # A mixed plan keeps the measured plan's length (the form read back from the cache,
    # on which the layer plan's key depends), though the rules' plan runs to 16 rows.
    rows_from = kernel_plan_module._rows_from
    assert rows_from((0, 3, 0), (0, 3, 3, 3, 3), frozenset({2})) == (0, 3, 3)
    assert rows_from((), (0, 3, 3), frozenset({2})) == (0, 0, 3)
    assert rows_from((0, 5, 0), (0, 0, 0), frozenset({1})) == ()  # all cuBLAS: no plan


def test_the_rules_plans_come_back_with_no_device_work_inside_the_turn(
    tmp_path, cpu_keys, monkeypatch
):
    # The steps wait while the turn is held: the new split-K counters (an allocation and a
    # fill each) are made before it, and only handed over inside.
    monkeypatch.setattr(kernel_plan_module, "small_gemm_plans_cached", lambda *a, **k: False)
    kp = _plan(CompileCache(tmp_path), _timer([], faster_unfused=()), small_gemm_rows=(1, 2))
    qkv = kp.model.layers[0].self_attn.qkv_proj
    qkv.use_plan((0, 3, 3), 4, False)
    kp.plan(defer=True)

    def measured(linears, rows, pdl, cache=None, turn=None):
        with turn():
            qkv.use_plan((0, 3, 0), 4, False)
        return []

    monkeypatch.setattr(kernel_plan_module, "plan_small_gemms", measured)
    kp.measure_deferred(None, contextlib.nullcontext)
    inside, made = [False], []
    new_counters = Linear.new_counters

    def spy(self, count):
        made.append(inside[0])
        return new_counters(self, count)

    @contextlib.contextmanager
    def turn():
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    monkeypatch.setattr(Linear, "new_counters", spy)
    kp.keep_rules_at(frozenset({2}), turn)
    assert qkv.plan == (0, 3, 3)
    assert made and not any(made)


def test_where_the_rules_graphs_won_a_later_start_reads_the_rules_layers(tmp_path, cpu_keys):
    cache, calls = CompileCache(tmp_path), []
    kp = _plan(cache, _timer(calls, faster_unfused=(2, 4)))
    kp.plan(defer=True)
    measured = _timer(calls, faster_unfused=(2, 4), faster_without_pdl=(2, 4))
    changed = kp.measure_deferred(measured, contextlib.nullcontext)
    assert changed == {2, 4} and kp.model.no_pdl_rows == {2, 4}
    kp.keep_rules_at(frozenset({4}), contextlib.nullcontext)  # fused, with PDL, won at 4 rows
    assert kp.model.unfused_rows == frozenset({2}) and kp.model.no_pdl_rows == frozenset({2})
    timed = len(calls)
    again = _plan(cache, _timer(calls))
    again.plan(defer=True)
    assert not again.deferred and again.model.unfused_rows == frozenset({2})
    assert again.model.no_pdl_rows == frozenset({2})
    assert len(calls) == timed  # read, not timed


@pytest.mark.parametrize(
    "verdicts, won",
    [
        ({(1, False): False, (2, False): True}, {1}),
        ({(2, False): False, (2, True): True}, set()),  # a size whose graphs disagree
        ({(4, False): False, (4, True): False}, {4}),
        ({}, set()),
    ],
)
def test_the_rules_win_a_size_only_where_every_graph_of_it_lost(verdicts, won):
    from ostinato.batch import BatchDescriptor
    from ostinato.engine.worker.deferred_plans import rules_won

    recaptured = {
        BatchDescriptor(num_tokens=n, uniform_decode=u): kept for (n, u), kept in verdicts.items()
    }
    assert rules_won(recaptured) == won


def _timed_plans_in(tmp_path):
    """``ModelRunner._kernel_plan`` as on a GPU: the layers are timed (the CPU has no
    timer; a timing before the graphs fails the test), the plans cached in ``tmp_path``."""
    real = ModelRunner._kernel_plan

    def kernel_plan(self, sizes, cache):
        kp = real(self, sizes, CompileCache(tmp_path))
        kp.layer_timer = lambda rows, unfused, pdl: pytest.fail("timed before the graphs")
        kp.layer_rows = sizes
        return kp

    return kernel_plan


def _engine(**kw):
    return engine("full", max_capture_size=16, async_scheduling=False, **kw)


@pytest.mark.parametrize("new_wins", [True, False])
def test_an_engine_serves_on_the_rules_then_captures_again_what_the_measured_plans_change(
    fake_graphs, monkeypatch, tmp_path, cpu_keys, new_wins
):
    import ostinato.engine.worker.deferred_plans as deferred_module

    # Which graph replays faster is the GPU's to say: both verdicts here.
    monkeypatch.setattr(deferred_module, "faster_replay", lambda sync: lambda *graphs: new_wins)
    unfused = {2} if new_wins else set()  # the rules' fused layers where their graph won
    prompts = [[(7 * i + j) % 900 + 1 for j in range(3 + 2 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in _engine(capture="blocking").generate(prompts, params)]
    timed = []

    def layer_timer(self, sizes, inputs=None, turn=contextlib.nullcontext):
        assert inputs is not self.inputs  # scratch inputs: the steps' are never touched

        def timer(rows, unfused, pdl):
            with turn():
                timed.append(self.manager.background.done)
                return 50.0 if unfused and rows == 2 else 100.0

        return timer

    monkeypatch.setattr(ModelRunner, "_kernel_plan", _timed_plans_in(tmp_path))
    monkeypatch.setattr(runner_module, "_layer_timer", layer_timer)
    # Closed at once (a one-shot generate): the plans are measured and stored first.
    _engine(capture="auto").close()
    assert timed and not any(timed)
    read = _engine(capture="auto")
    assert not read.engine.parts.startup.plans_deferred
    read.close()
    (tmp_path / "compile" / "gemm_plans.json").unlink()
    timed.clear()
    llm = _engine(capture="auto")
    runner = llm.engine.runner
    assert llm.engine.parts.startup.plans_deferred  # (set at construction: no race)
    assert "then the kernel plans measured" in llm.describe()
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.wait_for_graphs(timeout=60)
    assert timed and not any(timed)  # every timing inside the capture thread's turn
    twos = {d for d in runner.graphs.dispatcher.keys(GraphMode.FULL) if d.num_tokens == 2}
    assert twos and runner.deferred_plans.recaptured == dict.fromkeys(twos, new_wins)
    assert runner.model.unfused_rows == unfused
    assert "captured again" in llm.describe()
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    llm.close()
    # The next start reads the plan: nothing deferred, nothing timed, nothing recaptured.
    timed.clear()
    llm = _engine(capture="auto")
    assert not llm.engine.parts.startup.plans_deferred and llm.wait_for_graphs(timeout=60)
    assert timed == [] and llm.engine.runner.deferred_plans.recaptured == {}
    assert llm.engine.runner.model.unfused_rows == unfused
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    llm.close()


@pytest.mark.parametrize("new_wins", [True, False])
def test_a_blocking_start_measures_its_plans_after_its_graphs_and_keeps_the_faster(
    fake_graphs, monkeypatch, tmp_path, cpu_keys, new_wins
):
    # As a background start does, before it returns: the rules' graphs first, then the
    # plans measured, each changed size captured again and the faster graph kept.
    import ostinato.engine.worker.deferred_plans as deferred_module

    monkeypatch.setattr(deferred_module, "faster_replay", lambda sync: lambda *graphs: new_wins)
    unfused = {2} if new_wins else set()
    prompts = [[(5 * i + j) % 900 + 1 for j in range(2 + 3 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in _engine(capture="blocking").generate(prompts, params)]
    graphs_when_timed = []

    def layer_timer(self, sizes, inputs=None, turn=contextlib.nullcontext):
        assert inputs is not self.inputs

        def timer(rows, unfused, pdl):
            graphs_when_timed.append(self.manager.num_graphs)
            return 50.0 if unfused and rows == 2 else 100.0

        return timer

    monkeypatch.setattr(ModelRunner, "_kernel_plan", _timed_plans_in(tmp_path))
    monkeypatch.setattr(runner_module, "_layer_timer", layer_timer)
    llm = _engine(capture="blocking")
    runner = llm.engine.runner
    assert graphs_when_timed and min(graphs_when_timed) > 0  # after the graphs
    assert not runner.kernel_plan.deferred  # measured before the engine returned
    twos = {d for d in runner.graphs.dispatcher.keys(GraphMode.FULL) if d.num_tokens == 2}
    assert twos and runner.deferred_plans.recaptured == dict.fromkeys(twos, new_wins)
    assert runner.model.unfused_rows == unfused
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    llm.close()
    graphs_when_timed.clear()
    again = _engine(capture="blocking")  # reads the plans: nothing timed or recaptured
    assert graphs_when_timed == [] and again.engine.runner.deferred_plans.recaptured == {}
    assert again.engine.runner.model.unfused_rows == unfused
    assert [o.token_ids for o in again.generate(prompts, params)] == want
    again.close()


# (Sleeps ten times apart, or three: a loaded machine's oversleep, a few ms, once per
# three rounds, moves no median; 0.5 against 2 ms failed once beside other work.)
@pytest.mark.parametrize("new_s, kept", [(0.001, True), (0.03, False)])
def test_a_recaptured_graph_stays_only_where_its_replays_are_not_slower(new_s, kept):
    import time

    from ostinato.engine.worker.deferred_plans import faster_replay

    synced, order = [], []

    def replay(seconds, name):
        def run():
            order.append(name)
            time.sleep(seconds)

        return run

    @contextlib.contextmanager
    def held():
        order.append("(")
        yield
        order.append(")")

    class Synced(FakePlatform):
        def synchronize(self) -> None:
            synced.append(1)

    keep_new = faster_replay(Synced().held_seconds, rounds=3, replays=2)
    assert keep_new(replay(0.01, "old"), replay(new_s, "new"), held) is kept
    # Alternating rounds, each stage's replays back to back between two synchronizes,
    # each round in a hold of its own.
    assert order == ["(", "old", "old", ")", "(", "new", "new", ")"] * 3 and len(synced) == 12


def test_a_recapture_choice_holds_the_steps_for_one_replay_by_default():
    # A step beside waits for one replay of a graph, not a round of several.
    from ostinato.engine.worker.deferred_plans import faster_replay

    holds: list[list[str]] = []

    @contextlib.contextmanager
    def held():
        holds.append([])
        yield

    def replay(name):
        return lambda: holds[-1].append(name)

    faster_replay(FakePlatform().held_seconds)(replay("old"), replay("new"), held)
    assert len(holds) == 30 and all(len(h) == 1 for h in holds)
    assert [h[0] for h in holds] == ["old", "new"] * 15


def test_a_timer_that_times_the_device_decides_the_choice_alone():
    # What the choice compares is the platform's timing of each round (on CUDA the
    # device's clock): a round whose host took long but whose timer says fast counts fast.
    from ostinato.engine.worker.deferred_plans import faster_replay

    said = {"old": 2.0, "new": 1.0}
    calls = []

    def timer(fn, replays, held):
        with held():
            fn()
        calls.append(replays)
        return said[fn.__name__]

    def old():
        time.sleep(0.0)

    def new():
        time.sleep(0.002)  # slower by the host's clock, faster by the timer's

    assert faster_replay(timer, rounds=3)(old, new, contextlib.nullcontext) is True
    assert calls == [1] * 6
    said["new"] = 3.0
    assert faster_replay(timer, rounds=3)(old, new, contextlib.nullcontext) is False
