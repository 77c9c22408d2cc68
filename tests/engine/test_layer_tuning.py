"""Fused layers or not, per captured size, by measurement (``worker.layer_tuning``): the
choice against brute force over random timings, what a size chosen unfused runs, the
compile cache, the ranks' agreement (gloo), and where the runner measures at all."""

import contextlib
import json
import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp
from dist_workers import ahead_agreement, free_port, layer_plan_agreement
from fakes import FlaggedTurn
from test_fused_layers import _tiny_decode

from ostinato.engine import KernelOptions
from ostinato.engine.kernels.gemm_launch import MAX_ROWS
from ostinato.engine.kernels.launch import pdl_for, without_pdl
from ostinato.engine.kernels.launch_rules import rules, rules_in_force
from ostinato.engine.model import decoder, fused_ops
from ostinato.engine.model.attention import TorchAttention
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.model.presets import shape
from ostinato.engine.worker import layer_tuning
from ostinato.engine.worker import runner as runner_module
from ostinato.engine.worker.compile_cache import CompileCache
from ostinato.engine.worker.layer_tuning import MARGIN, plan_layers
from ostinato.modes import GraphMode


def _model(**kernels) -> DecoderModel:
    return DecoderModel(ModelConfig.from_hf(shape("tiny")), kernels=KernelOptions(**kernels))


@pytest.mark.parametrize("seed", range(20))
def test_a_size_runs_unfused_or_without_pdl_only_where_it_measured_faster_by_the_margin(seed):
    # Brute force: every variant of every size timed, then each choice made by hand.
    rng = random.Random(seed)
    sizes = sorted(rng.sample([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64], 6))
    times = {(r, u, p): rng.uniform(90, 110) for r in sizes for u in (0, 1) for p in (0, 1)}
    model, timed = _model(pdl=True), []

    def timer(rows, unfused, pdl):
        timed.append((rows, unfused, pdl))
        return times[rows, unfused, pdl]

    timings = plan_layers(model, sizes, timer)
    small = [r for r in sizes if r <= MAX_ROWS]
    assert sorted(timed) == sorted((r, u, p) for r in small for u in (0, 1) for p in (0, 1))
    assert [t.rows for t in timings] == small
    unfused, no_pdl = set(), set()
    for r in small:
        # Faster than fused with PDL by the margin; of those, the first of fused with PDL,
        # unfused with PDL, fused without, unfused without that is within the margin of
        # the fastest.
        default = times[r, 0, 1]
        faster = [
            (u, p) for u in (0, 1) for p in (0, 1) if times[r, u, p] * (1 + MARGIN) <= default
        ]
        if not faster:
            continue
        fastest = min(times[r, u, p] for u, p in faster)
        near = [(u, p) for u, p in faster if times[r, u, p] <= fastest * (1 + MARGIN)]
        u, p = min(near, key=lambda v: (not v[1], v[0]))  # PDL first, then fused first
        unfused |= {r} if u else set()
        no_pdl |= set() if p else {r}
    assert model.unfused_rows == unfused and model.no_pdl_rows == no_pdl
    assert all(layer.unfused_rows == unfused for layer in model.layers)


@pytest.mark.parametrize(
    "us, chosen",
    [
        # The 8 B shape's one-row readings on an H200 (tp_step_kernels_h200x2/call3, TP=1):
        # unfused without PDL read 0.3% faster than with it; the decode benchmark of the
        # same run found the layers with PDL 2.4% faster. Within the margin, PDL stays.
        ((4563.0, 4426.0, 4489.0, 4412.0), (True, True)),
        # Another run's (tp_step_kernels_h200/rules_8b_h200.json): a 0.8% lead, the same.
        ((4497.5, 4388.0, 4517.7, 4353.0), (True, True)),
        # Its two-row readings (qkv_plan_8b.json): without PDL 1.9% faster, taken.
        ((4599.9, 4461.2, 4604.2, 4376.6), (True, False)),
        # Nothing faster than fused with PDL by the margin: that one.
        ((100.0, 99.5, 99.2, 99.4), (False, True)),
        # Fused without PDL and unfused with it within the margin: unfused (PDL kept).
        ((100.0, 97.0, 96.5, 99.0), (True, True)),
        # Without PDL (fused) faster than every variant with it by the margin.
        ((100.0, 98.0, 96.0, 99.5), (False, False)),
    ],
)
def test_of_variants_within_the_margin_the_one_with_pdl_and_fewer_kernels_runs(us, chosen):
    assert layer_tuning.LayerTiming(1, *us).chosen == chosen


def test_without_pdl_in_the_options_or_the_launch_rules_nothing_is_timed_without_it():
    def timer(rows, unfused, pdl):
        assert pdl, "timed without PDL where the kernels launch without it anyway"
        return 1.0 if rows == 2 else 2.0

    model = _model(pdl=False)
    model.no_pdl_rows = frozenset({2})  # an earlier plan is cleared
    timings = plan_layers(model, [1, 2], timer)
    assert [t.fused_no_pdl_us for t in timings] == [None, None]
    assert [t.unfused_no_pdl_us for t in timings] == [None, None]
    assert model.no_pdl_rows == frozenset()
    with rules_in_force(replace(rules(), pdl_max_rows=1)):
        model = _model(pdl=True)
        timings = plan_layers(model, [1, 2], lambda r, u, p: 1.0 if p else 0.5)
    assert [(t.rows, t.fused_no_pdl_us) for t in timings] == [(1, 0.5), (2, None)]
    assert model.no_pdl_rows == frozenset({1}) and model.unfused_rows == frozenset()  # (a tie)


def test_pdl_is_off_inside_without_pdl_on_that_thread_alone():
    import threading

    inside, seen, found = threading.Event(), threading.Event(), {}

    def timing():
        with without_pdl():
            with without_pdl(False):  # (nested: still off)
                found["timing"] = pdl_for(True, 1)
            inside.set()
            seen.wait(5)
        found["after"] = pdl_for(True, 1)

    thread = threading.Thread(target=timing)
    thread.start()
    assert inside.wait(5)
    steps = pdl_for(True, 1)
    seen.set()
    thread.join()
    assert found == {"timing": False, "after": True} and steps
    assert not pdl_for(True, rules().pdl_max_rows + 1) and not pdl_for(False, 1)
    model = _model()
    model.no_pdl_rows = frozenset({4})
    for rows, want in ((4, False), (2, True)):
        with model.launches_at(rows):
            assert pdl_for(True, 1) is want


def test_nothing_is_measured_without_fused_layers_or_small_sizes():
    def timer(rows, unfused, pdl):
        raise AssertionError("timed")

    assert plan_layers(_model(fused_layers=False), [1, 2], timer) == []
    model = _model()
    model.unfused_rows = frozenset({1})  # an earlier plan is cleared
    assert plan_layers(model, [32, 64], timer) == [] and model.unfused_rows == frozenset()


def test_a_threads_own_unfused_rows_leave_another_threads_steps_on_the_models_plan():
    # A layer timing beside the steps runs its variant through unfused_here: the steps'
    # thread (here the main one) keeps the model's plan while the timing's thread runs it.
    import threading

    model = _model()
    model.unfused_rows = frozenset({4})
    inside, seen = threading.Event(), threading.Event()
    found = {}

    def timing():
        with model.unfused_here(frozenset({2})):
            found["timing"] = [layer.fuses(r) for layer in model.layers[:1] for r in (2, 4)]
            inside.set()
            seen.wait(5)
        found["after"] = [model.layers[0].fuses(r) for r in (2, 4)]

    thread = threading.Thread(target=timing)
    thread.start()
    assert inside.wait(5)
    steps = [model.layers[0].fuses(r) for r in (2, 4)]
    seen.set()
    thread.join()
    assert found["timing"] == [False, True]  # its variant: unfused at 2 alone
    assert steps == [True, False] and found["after"] == [True, False]  # the model's plan


def test_a_plan_is_measured_once_then_read_from_the_compile_cache(tmp_path, cpu_keys):
    cache, calls = CompileCache(tmp_path), []

    def timer(rows, unfused, pdl):
        calls.append(rows)
        if not pdl:
            return 40.0 if rows == 4 else 200.0
        return 50.0 if unfused and rows == 2 else 100.0

    assert plan_layers(_model(pdl=True), [1, 2, 4], timer, cache)  # 4 timings a size
    again = _model(pdl=True)
    assert plan_layers(again, [1, 2, 4], timer, cache) == [] and len(calls) == 12
    assert again.unfused_rows == frozenset({2}) and again.no_pdl_rows == frozenset({4})
    # compile_ahead only moves compile time: the same plan.
    assert plan_layers(_model(pdl=True, compile_ahead=False), [1, 2, 4], timer, cache) == []
    # Another launch option, or other sizes, is another plan.
    assert plan_layers(_model(pdl=False), [1, 2, 4], timer, cache) and len(calls) == 18
    assert plan_layers(_model(pdl=True), [1, 2], timer, cache) and len(calls) == 26
    # A plan of the form before PDL was measured (the unfused sizes alone) is measured again.
    model = _model(pdl=True)
    keys = layer_tuning._cache_keys(model, [1, 2, 4], cache)
    plans = cache.load_plans()
    del plans[keys[1]]
    (cache.folder / "gemm_plans.json").write_text(json.dumps(plans))
    assert plan_layers(model, [1, 2, 4], timer, cache) and len(calls) == 38


def test_ranks_measure_together_and_take_the_slowest_ranks_timings(tmp_path):
    # Rank 0 alone has a cached plan and alone measured its unfused 4-row step, and its
    # 2-row step without PDL, faster: both measure, and with rank 1's slower timings
    # neither runs 4 rows unfused or 2 rows without PDL.
    mp.spawn(layer_plan_agreement, args=(2, free_port(), str(tmp_path)), nprocs=2)
    results = [torch.load(Path(tmp_path) / f"{r}.pt") for r in range(2)]
    for chosen, timed in results:
        assert chosen == ([], [])  # (nor does either step without PDL at 2 rows)
        assert timed == [(r, u, p) for p in (True, False) for r in (1, 2, 4) for u in (False, True)]


def test_a_size_chosen_unfused_runs_the_unfused_layers_with_the_same_logits():
    setup, step = _tiny_decode()  # a decode step of 4 rows
    runner = setup.runner(GraphMode.NONE, None, TorchAttention(), KernelOptions())
    layers, logits = len(runner.model.layers), []
    for unfused in (frozenset(), frozenset({4}), frozenset({3, 8})):
        runner.model.unfused_rows = unfused
        add = decoder.RMSNorm.add
        with (
            mock.patch.object(fused_ops, "_norm_into", wraps=fused_ops._norm_into) as norms,
            mock.patch.object(decoder.RMSNorm, "add", autospec=True, side_effect=add) as adds,
            torch.inference_mode(),
        ):
            runner.model.lm_head.use_plan((0, 1, 1, 1, 1), 4, False)
            logits.append(runner.execute(step).logits.clone())
        fused = 4 not in unfused
        assert norms.call_count == (layers if fused else 0), norms.call_count
        assert adds.call_count == (0 if fused else 2 * layers), adds.call_count
    runner.release()
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_the_runner_times_layers_only_on_cuda_with_graphs_and_fused_layers():
    setup, _ = _tiny_decode()
    for mode in (GraphMode.NONE, GraphMode.FULL):
        runner = setup.runner(mode, None, TorchAttention(), KernelOptions())
        assert runner.kernel_plan.layer_timer is None  # the CPU
        runner.release()
    # As on a GPU: a CUDA device whose graphs are FULL (the CPU resolves every mode to NONE).
    runner = setup.runner(GraphMode.FULL, None, TorchAttention(), KernelOptions())
    graphs, runner.graphs = runner.graphs, SimpleNamespace(mode=GraphMode.FULL)
    runner.device = torch.device("cuda")
    with mock.patch.object(runner_module, "graph_timer", return_value="timer") as made:
        assert runner._kernel_plan((1, 2, 4), None).layer_timer == "timer"
        runner.kernels = KernelOptions(fused_layers=False)
        assert runner._kernel_plan((1, 2, 4), None).layer_timer is None
        runner.kernels = KernelOptions()
        runner.graphs = SimpleNamespace(mode=GraphMode.NONE)
        assert runner._kernel_plan((1, 2, 4), None).layer_timer is None
        assert made.call_count == 1 and "turn" not in made.call_args.kwargs
        # Beside running steps each held replay is one step's (a step waits for two).
        held = mock.Mock()
        runner_module._layer_timer(runner, (1, 2), None, held)
        assert made.call_args.kwargs == {"steps": 1, "replays": 9, "turn": held}
    runner.graphs, runner.device = graphs, torch.device("cpu")
    runner.release()


class _VariantModel:
    """The timer's view of a model: ``unfused_here`` (the variant, this thread's) and
    ``logits``, which calls ``ran(rows, unfused, pdl)`` (``pdl``: whether this thread's
    launches would use PDL: ``launch.without_pdl``)."""

    def __init__(self, ran) -> None:
        self.here, self.ran = frozenset(), ran

    @contextlib.contextmanager
    def unfused_here(self, rows):
        before, self.here = self.here, rows
        try:
            yield
        finally:
            self.here = before

    def logits(self, ids, pos):
        self.ran(len(ids), len(ids) in self.here, pdl_for(True, 1))


def test_with_compile_ahead_every_timed_variant_is_launched_inside_it_before_any_timing(
    monkeypatch,
):
    # The GPU test of compile_ahead found the unfused layers' kernels compiled at the
    # timer's first launches, one after another: every (size, fused or not) the timings
    # launch must first be queued inside one compile_ahead(), before any is timed.
    import contextlib

    from ostinato.engine.worker import layer_tuning

    inside, launched, timed = [False], [], []

    @contextlib.contextmanager
    def ahead():
        inside[0] = True
        yield
        inside[0] = False

    def recording():
        def ran(rows, unfused, pdl):
            launched.append((rows, unfused, pdl, inside[0]))

        return _VariantModel(ran)

    def captured_calls(step, steps):
        timed.append(len(launched))
        return "graph"

    monkeypatch.setattr(layer_tuning, "compile_ahead", ahead)
    monkeypatch.setattr(layer_tuning, "captured_calls", captured_calls)
    monkeypatch.setattr(layer_tuning, "held_replays_us", lambda graph, replays, turn: 4.0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    ids = torch.zeros(64, dtype=torch.long)
    context = lambda n: contextlib.nullcontext()  # noqa: E731
    timer = layer_tuning.graph_timer(recording(), ids, ids, context, rows_ahead=(1, 4, 32))
    timer(4, True, True)
    timer(1, False, True)
    variants = [(1, False), (1, True), (4, False), (4, True)]  # not 32 (> MAX_ROWS)
    first = [(n, u, p) for n, u, p, was_inside in launched[:4] if was_inside]
    assert sorted(first) == [(n, u, True) for n, u in variants]
    assert not any(was_inside for *_, was_inside in launched[4:]) and timed[0] > 4
    # The first timing without PDL queues every variant without it, in one pass.
    before = len(launched)
    timer(4, False, False)
    timer(1, True, False)
    again = [(n, u, p) for n, u, p, was_inside in launched[before:] if was_inside]
    assert sorted(again) == [(n, u, False) for n, u in variants] and len(timed) == 4
    assert launched[-1] == (1, True, False, False)  # (the timed step, without PDL)
    plain = layer_tuning.graph_timer(recording(), ids, ids, context)
    launched.clear()
    plain(2, False, True)
    assert launched == [(2, False, True, False)]


def test_a_layer_timing_holds_the_turn_for_each_replay_alone(monkeypatch):
    # The eager step runs on the measurement's own inputs, its kernels queued behind the
    # steps' on their shared stream: no hold; the capture runs nothing: none; the timed
    # replays each hold the turn apart (held_replays_us). The variant is the timing
    # thread's alone.
    import contextlib

    from ostinato.engine.worker import layer_tuning

    turn, seen = FlaggedTurn(), []

    def captured_calls(step, steps):
        seen.append(("capture", turn.held, model.here))
        return "graph"

    def held_replays_us(graph, replays, given):
        seen.append(("replays", turn.held, given is turn, replays))
        return 8.0

    monkeypatch.setattr(layer_tuning, "captured_calls", captured_calls)
    monkeypatch.setattr(layer_tuning, "held_replays_us", held_replays_us)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    ids = torch.zeros(8, dtype=torch.long)
    model = _VariantModel(lambda rows, unfused, pdl: seen.append(("eager", turn.held, unfused)))
    timer = layer_tuning.graph_timer(
        model, ids, ids, lambda n: contextlib.nullcontext(), steps=4, replays=5, turn=turn
    )
    assert timer(2, True, True) == 2.0  # (per step of the four)
    assert seen == [
        ("eager", False, True),
        ("capture", False, frozenset({2})),
        ("replays", False, True, 5),
    ]
    assert model.here == frozenset()  # (the variant ends with the timing)


def test_compile_ahead_holds_only_for_a_start_that_measured_its_plans(tmp_path, cpu_keys):
    # Plans read back from the compile cache mean an earlier start compiled the kernels:
    # its compile-ahead passes would only look them up, beside the first steps.
    from ostinato.engine.core.limits import EngineLimits
    from ostinato.engine.worker.kernel_plan import KernelPlan

    cache, limits = CompileCache(tmp_path), EngineLimits(4, 64, 64, 16)

    def plan(kernels: KernelOptions, cache: CompileCache | None) -> KernelPlan:
        kp = KernelPlan(
            _model(), kernels, limits, (), cache, None, lambda rows, unfused, pdl: 1.0, (1, 2, 4)
        )
        kp.plan()
        return kp

    ahead = KernelOptions(compile_ahead=True)
    first = plan(ahead, cache)
    assert first.layer_timings and first.ahead and first.compiles_kernels
    again = plan(ahead, cache)  # every plan from the cache
    assert not again.layer_timings and not again.ahead and not again.compiles_kernels
    assert plan(ahead, None).ahead  # no cache: measured again
    assert not plan(KernelOptions(compile_ahead=False), None).ahead


def test_the_start_up_line_names_the_gemm_and_layer_plans_apart(tmp_path, cpu_keys):
    import time

    from ostinato.engine.api.engine import StartupTimes
    from ostinato.engine.core.limits import EngineLimits
    from ostinato.engine.worker.kernel_plan import KernelPlan

    def slow_layer(rows, unfused, pdl):
        time.sleep(0.05)
        return 1.0

    model = _model()
    kp = KernelPlan(
        model, model.kernels, EngineLimits(4, 64, 64, 16), (), CompileCache(tmp_path),
        None, slow_layer, (1, 2),
    )  # fmt: skip
    kp.plan()
    assert kp.layer_seconds >= 0.2 and kp.gemm_seconds < kp.layer_seconds  # 4 or 6 timings
    times = StartupTimes(0.4, 1.0, 0.0, 0.0, 30.0, background=True, kernels_s=19.0)
    times.gemm_plan_s, times.layer_plan_s = 12.1, kp.layer_seconds
    line = times.summary()
    assert f"kernel plans 19.0, gemm plan 12.1, layer plan {kp.layer_seconds:.1f};" in line
    times.gemm_plan_s = times.layer_plan_s = 0.04  # under a tenth: not named
    assert "kernel plans 19.0; compile" in times.summary()


def test_ranks_compile_ahead_together_where_any_of_them_measured(tmp_path):
    mp.spawn(ahead_agreement, args=(2, free_port(), str(tmp_path)), nprocs=2)
    assert [torch.load(Path(tmp_path) / f"{r}.pt") for r in range(2)] == [(True, True)] * 2


def test_a_step_of_a_size_measured_faster_without_pdl_launches_without_it(monkeypatch):
    # Where it was measured (a step of the eager model in a FULL graph), and there alone:
    # a compiled or piecewise step of the same size launches as its kernels ask.
    from ostinato.batch import BatchDescriptor
    from ostinato.context import forward_context

    setup, _ = _tiny_decode()
    runner = setup.runner(GraphMode.NONE, None, TorchAttention(), KernelOptions())
    runner.model.no_pdl_rows = frozenset({4})
    seen = []
    for name in ("logits", "forward", "compute_logits"):
        real = getattr(runner.model, name)

        def recording(*args, real=real, name=name, **kwargs):
            seen.append((name, pdl_for(True, 1)))
            return real(*args, **kwargs)

        monkeypatch.setattr(runner.model, name, recording)
    monkeypatch.setattr(runner, "forward", runner.model.forward)  # (the compiled model's stand-in)
    steps = [(4, GraphMode.FULL, False), (2, GraphMode.FULL, True), (4, GraphMode.PIECEWISE, True)]
    with torch.inference_mode():
        for n, mode, pdl in steps:
            seen.clear()
            d = BatchDescriptor(n, n, uniform_decode=True)
            with forward_context(mode, d, runner.dummy_metadata(d)):
                runner.step_as(d, False, mode=mode)
            eager = mode is GraphMode.FULL
            assert seen[0][0] == ("logits" if eager else "forward"), seen
            assert all(on is pdl for _, on in seen), (n, mode, seen)
    runner.release()
