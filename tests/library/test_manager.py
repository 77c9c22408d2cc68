import gc

import pytest
import torch
from fakes import FakePlatform, FlaggedTurn, copies_into

from ostinato import (
    BatchDescriptor,
    Dispatcher,
    GraphCaptureError,
    GraphConfig,
    GraphManager,
    GraphMode,
    GraphWrapper,
    current_forward_context,
    use_platform,
)
from ostinato.engine.cli.demo import TinyModel, TinyRunner, run_demo


class Runner:
    """A runner with a persistent input buffer and, optionally, an auxiliary output."""

    def __init__(self, platform, max_tokens=64, aux=False):
        self.p = platform
        self.x = torch.zeros(max_tokens, 3)
        self.w = torch.randn(3, 5)
        self.aux = aux
        self.steps: list[tuple[BatchDescriptor, GraphMode, bool]] = []
        self.prepared: list[BatchDescriptor] = []

    def prepare(self, d):
        self.prepared.append(d)
        return f"meta{d.num_tokens}"

    def step(self, d):
        ctx = current_forward_context()
        self.steps.append((d, ctx.runtime_mode, gc.isenabled()))
        assert ctx.attn_metadata in (None, f"meta{d.num_tokens}")
        n = d.num_tokens
        out = self.x[:n] @ self.w
        if self.aux:
            return out, self.x[:n].sum(1)
        return out


def build(mode, sizes=(1, 2, 4, 8), aux=False, **dispatcher_kwargs):
    p = FakePlatform()
    r = Runner(p, aux=aux)
    d = Dispatcher(GraphConfig(mode=mode, capture_sizes=sizes), **dispatcher_kwargs)
    m = GraphManager(
        r.step, d, prepare=r.prepare, num_warmups=2, platform=p, pool="pool", progress=False
    )
    return p, r, m


def test_capture_plan_order_mixed_then_piecewise_then_uniform_largest_first():
    p, r, m = build(GraphMode.FULL_AND_PIECEWISE)
    plan = [
        (i.mode, i.descriptor.num_tokens, i.descriptor.uniform_decode) for i in m.capture_plan()
    ]
    assert plan == [
        (GraphMode.PIECEWISE, 8, False),
        (GraphMode.PIECEWISE, 4, False),
        (GraphMode.PIECEWISE, 2, False),
        (GraphMode.PIECEWISE, 1, False),
        (GraphMode.FULL, 8, True),
        (GraphMode.FULL, 4, True),
        (GraphMode.FULL, 2, True),
        (GraphMode.FULL, 1, True),
    ]


def test_capture_warms_up_then_captures_each_size_once_with_gc_paused():
    p, r, m = build(GraphMode.FULL)
    report = m.capture()
    assert m.num_graphs == 4 and len(p.graphs) == 4
    assert [d.num_tokens for d in r.prepared] == [8, 4, 2, 1]
    # two eager warm-ups (NONE) then one capture (FULL) per size, largest first
    modes = [(d.num_tokens, mode) for d, mode, _ in r.steps]
    assert modes[:3] == [(8, GraphMode.NONE)] * 2 + [(8, GraphMode.FULL)]
    assert len(modes) == 12
    assert not any(gc_on for _, _, gc_on in r.steps), "gc must be paused during capture"
    assert gc.isenabled()
    assert report.num_graphs == 4 and report.pool_bytes == 4 * 1024
    assert [rec.descriptor.num_tokens for rec in report.records] == [8, 4, 2, 1]
    assert all(rec.seconds > 0 for rec in report.records)
    assert "4 graphs captured" in report.summary()


def test_full_replay_returns_static_outputs_sliced_to_real_size():
    p, r, m = build(GraphMode.FULL, aux=True)
    m.capture()
    calls = len(r.steps)
    r.x[:3] = torch.randn(3, 3)
    plan = m.dispatcher.dispatch(3)
    assert plan.mode is GraphMode.FULL and plan.padded_tokens == 4
    out, aux = m.run(plan, 3)
    assert len(r.steps) == calls, "FULL replay must not run the step"
    assert out.shape == (3, 5) and aux.shape == (3,)
    torch.testing.assert_close(out, r.x[:3] @ r.w)
    torch.testing.assert_close(aux, r.x[:3].sum(1))


def test_two_managers_share_static_outputs_and_refuse_a_step_shaped_otherwise():
    # A second manager over the first's buffers (a staged upgrade): its graphs write
    # where the first's replays are read; a step of other shapes or dtypes is named.
    p, r, first = build(GraphMode.FULL)
    first.capture()
    d = Dispatcher(GraphConfig(mode=GraphMode.FULL, capture_sizes=(1, 2, 4, 8)))
    second = GraphManager(r.step, d, platform=p, pool="pool", outputs=first.outputs)
    second.capture()
    r.x[:3] = torch.randn(3, 3)
    out = second.run(second.dispatcher.dispatch(3), 3)
    assert out.data_ptr() == first.outputs.buffers[0].data_ptr()
    torch.testing.assert_close(out, r.x[:3] @ r.w)
    other = GraphManager(
        lambda d: (r.x[: d.num_tokens] @ r.w).double(), d, platform=p, outputs=first.outputs
    )
    with pytest.raises(GraphCaptureError, match="static outputs: the step returned"):
        other.capture()
    small = Dispatcher(GraphConfig(mode=GraphMode.FULL, capture_sizes=(16,)))
    with pytest.raises(ValueError, match="outputs: shared static outputs of 8 rows"):
        GraphManager(r.step, small, platform=p, outputs=first.outputs)


def test_a_lender_recalls_what_it_lent_before_any_writer_takes_its_lock():
    from ostinato.graph_outputs import OutputLender, lent_anywhere, shared_lender

    lends, copies = FakePlatform(lends=True), FakePlatform()
    lender, out = OutputLender("pool"), torch.randn(4, 3)
    copy = lender.lend(out[:2], copies, "kept", owner="a")  # cannot revoke: a copy
    assert copy.data_ptr() != out.data_ptr() and not lender.is_lent(copy)
    lent = lender.lend(out[:2], lends, "kept", owner="a")
    other = lender.lend(out[2:], lends, "other's", owner="b")
    assert lent.data_ptr() == out.data_ptr() and lender.is_lent(lent[1:])
    lender.recall(owner="b")  # (a release: only its own)
    assert lends.revoked == [(1, "other's")] and lender.is_lent(lent)
    assert not lent_anywhere(lent)  # (only the process's shared lenders are looked at)
    shared = shared_lender(lends)
    assert shared is shared_lender(lends) and shared.pool == ("pool", 1)
    kept = shared.lend(out, lends, "kept", owner="c")
    assert lent_anywhere(kept[1:]) and not lent_anywhere(torch.zeros(2))
    with lender.writing():
        assert lends.revoked == [(1, "other's"), (0, "kept")] and not lender.is_lent(lent)
    lender.recall()  # (nothing left to recall)
    assert len(lends.revoked) == 2 and other.shape == (2, 3)
    shared.recall()
    assert lends.revoked[-1] == (2, "kept") and not lent_anywhere(kept)


def test_verify_graphs_beside_another_check_is_refused_by_name():
    # verify_graphs=True is the capture check: beside another, one of them was lost.
    from ostinato.replay_check import ReplayCheck

    p, r, _ = build(GraphMode.FULL)
    d = Dispatcher(GraphConfig(mode=GraphMode.FULL, capture_sizes=(1, 2)))
    for check in (ReplayCheck("sample"), ReplayCheck("off")):
        with pytest.raises(
            ValueError, match=r"verify_graphs=True is check=ReplayCheck\('capture'\)"
        ):
            GraphManager(r.step, d, platform=p, verify_graphs=True, check=check)
    m = GraphManager(r.step, d, platform=p, verify_graphs=True, check=ReplayCheck("capture"))
    assert m.check == ReplayCheck("capture")


def test_pool_outputs_are_each_graphs_own_outputs():
    # No buffer apart: a replay returns its graph's own outputs (where the capture
    # allocated them), each graph's elsewhere.
    from ostinato.graph_outputs import PoolOutputs

    p, r, _ = build(GraphMode.FULL)
    outputs = PoolOutputs()
    d = Dispatcher(GraphConfig(mode=GraphMode.FULL, capture_sizes=(1, 2, 4, 8)))
    m = GraphManager(r.step, d, platform=p, pool="pool", outputs=outputs, verify_graphs=True)
    m.capture()
    assert outputs.into(4) is None
    r.x[:8] = torch.randn(8, 3)
    three = m.run(m.dispatcher.dispatch(3), 3)
    torch.testing.assert_close(three, r.x[:3] @ r.w)
    eight = m.run(m.dispatcher.dispatch(8), 8)
    torch.testing.assert_close(eight, r.x[:8] @ r.w)
    entries = m._full.entries
    assert len({e.output.data_ptr() for e in entries.values()}) == 4  # (fakes keep all)
    assert three.data_ptr() == entries[m.dispatcher.dispatch(3).descriptor].output.data_ptr()
    assert outputs.holds(three[1:]) and outputs.holds(eight) and not outputs.holds(r.x)
    m.release()
    assert not outputs.holds(three)


def test_single_output_is_returned_as_tensor():
    p, r, m = build(GraphMode.FULL)
    m.capture()
    out = m.run(m.dispatcher.dispatch(5), 5)
    assert isinstance(out, torch.Tensor) and out.shape == (5, 5)


def test_eager_above_largest_size_and_piecewise_sliced():
    p, r, m = build(GraphMode.FULL_AND_PIECEWISE)
    m.capture()
    plan = m.dispatcher.dispatch(3, uniform_decode=False)
    assert plan.mode is GraphMode.PIECEWISE
    out = m.run(plan, 3, attn_metadata=None)
    assert out.shape == (3, 5)
    plan = m.dispatcher.dispatch(40)
    assert plan.mode is GraphMode.NONE and plan.padded_tokens == 40
    assert m.run(plan, 40).shape == (40, 5)


def test_full_without_capture_is_an_error():
    p, r, m = build(GraphMode.FULL)
    with pytest.raises(KeyError, match="no FULL graph was captured"):
        m.run(m.dispatcher.dispatch(2), 2)


def test_step_output_must_be_token_major():
    p = FakePlatform()
    d = Dispatcher(GraphConfig(mode=GraphMode.FULL, capture_sizes=(4,)))
    m = GraphManager(lambda d: torch.zeros(3), d, platform=p, pool=1, progress=False)
    with pytest.raises(ValueError, match="must be a tensor with 4 rows"):
        m.capture()


def test_piecewise_wrappers_inside_step_capture_in_their_mode():
    p = FakePlatform()
    inner = GraphWrapper(lambda x: x * 2, GraphMode.PIECEWISE, platform=p, pool=1)
    buf = torch.ones(8)
    d = Dispatcher(GraphConfig(mode=GraphMode.PIECEWISE, capture_sizes=(2, 8)))
    m = GraphManager(
        lambda desc: inner(buf[: desc.num_tokens]), d, platform=p, pool=1, progress=False
    )
    report = m.capture()
    assert len(inner.entries) == 2 and m.num_graphs == 0
    assert [r.mode for r in report.records] == [GraphMode.PIECEWISE] * 2


def test_release_resets_all_graphs():
    p, r, m = build(GraphMode.FULL)
    m.capture()
    m.release()
    assert m.num_graphs == 0 and all(g.was_reset for g in p.graphs)


def test_cpu_platform_end_to_end_runs_none_with_same_code():
    from ostinato.platform import CpuPlatform

    with use_platform(CpuPlatform()):
        model = TinyModel(layers=2).eval()
        runner = TinyRunner(
            model, GraphConfig(max_capture_size=32), torch.device("cpu"), progress=False
        )
        assert runner.graphs.mode is GraphMode.NONE
        runner.capture()
        assert runner.graphs.manager.num_graphs == 0
        for n in (1, 7, 32, 50):
            ids = torch.randint(0, 1000, (n,))
            with torch.inference_mode():
                assert torch.equal(runner.forward(ids), model(ids))


def test_demo_on_cpu():
    from ostinato.platform import CpuPlatform

    with use_platform(CpuPlatform()):
        r = run_demo(num_steps=5, progress=False)
    assert r.platform == "cpu" and r.mode is GraphMode.NONE and r.max_abs_error == 0.0


@pytest.mark.parametrize("mode", [GraphMode.FULL, GraphMode.NONE])
def test_run_refuses_rows_nobody_computed(mode):
    p, r, m = build(mode)
    with use_platform(p):
        m.capture()
        plan = m.dispatcher.dispatch(3)
        padded = plan.padded_tokens
        assert padded == (4 if mode is GraphMode.FULL else 3)
        assert m.run(plan, padded).shape[0] == padded  # padding rows were computed
        for bad in (padded + 1, -1):
            with pytest.raises(ValueError, match=f"num_tokens: {bad} rows asked of a step"):
                m.run(plan, bad)


def test_out_of_memory_in_warm_up_releases_every_graph():
    p, r, m = build(GraphMode.FULL)
    real = r.step

    def step(d):
        if d.num_tokens == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(d)

    m.step = step
    with use_platform(p), pytest.raises(GraphCaptureError, match="ran out of device memory"):
        m.capture()
    assert m.num_graphs == 0


def test_run_names_a_descriptor_passed_where_the_dispatch_goes():
    p, r, m = build(GraphMode.FULL)
    m.capture()
    with pytest.raises(TypeError, match="expected the Dispatch that dispatch.num_tokens. returns"):
        m.run(BatchDescriptor(8), 8)
    with pytest.raises(TypeError, match="num_tokens: expected an int, got 2.5"):
        m.run(m.dispatcher.dispatch(3), 2.5)


def test_the_shared_pool_is_one_per_platform_until_released():
    from ostinato.pool import release_shared_pool, shared_pool

    platform, other = FakePlatform(), FakePlatform()
    first = shared_pool(platform)
    assert shared_pool(platform) == first and shared_pool(other) == ("pool", 1)
    release_shared_pool(platform)
    assert shared_pool(platform) == ("pool", 2) and shared_pool(other) == ("pool", 1)


class WritingRunner(Runner):
    """Writes its first output into the rows a FULL capture offers, as an engine's
    decode step writes its logits."""

    def __init__(self, platform):
        super().__init__(platform, aux=True)
        self.offered: list[tuple[GraphMode, bool]] = []

    def step(self, d):
        ctx = current_forward_context()
        self.offered.append((ctx.runtime_mode, ctx.outputs is not None))
        n = d.num_tokens
        if ctx.outputs is None:
            return self.x[:n] @ self.w, self.x[:n].sum(1)
        out, _ = ctx.outputs
        return torch.mm(self.x[:n], self.w, out=out), self.x[:n].sum(1)


def test_a_step_that_writes_the_offered_rows_records_no_copy_of_them():
    p = FakePlatform()
    r = WritingRunner(p)
    d = Dispatcher(GraphConfig(mode=GraphMode.FULL, capture_sizes=(2, 4)))
    m = GraphManager(r.step, d, num_warmups=1, platform=p, pool="pool", progress=False)
    m.capture()
    # Offered only while a FULL graph is captured, never to the eager warm-ups.
    assert (GraphMode.FULL, True) in r.offered
    assert (GraphMode.NONE, True) not in r.offered
    assert (GraphMode.FULL, False) not in r.offered
    first, second = m.outputs.buffers
    for graph in p.graphs:
        assert copies_into(graph, first) == []  # written in place
        assert len(copies_into(graph, second)) == 1  # returned fresh: copied
    r.x[:3] = torch.randn(3, 3)
    out, aux = m.run(d.dispatch(3), 3)
    torch.testing.assert_close(out, r.x[:3] @ r.w)
    torch.testing.assert_close(aux, r.x[:3].sum(1))


def test_a_step_that_ignores_the_offered_rows_is_copied():
    p, r, m = build(GraphMode.FULL, sizes=(2, 4), aux=True)
    m.capture()
    first, second = m.outputs.buffers
    for graph in p.graphs:
        assert len(copies_into(graph, first)) == len(copies_into(graph, second)) == 1


def test_a_sampled_check_still_compares_a_step_that_writes_in_place():
    """The sampled check's eager run gets no offered rows, so it cannot overwrite the
    replay's outputs it is compared with: a graph that froze a stale value is caught."""
    from ostinato import GraphDemotedWarning, ReplayCheck

    p = FakePlatform()
    r = WritingRunner(p)
    d = Dispatcher(GraphConfig(mode=GraphMode.FULL, capture_sizes=(2,)))
    m = GraphManager(
        r.step, d, num_warmups=1, platform=p, pool="pool", progress=False,
        check=ReplayCheck("sample", every=1),
    )  # fmt: skip
    m.capture()
    r.w = torch.randn(3, 5)  # a new tensor: the graph still reads the old one
    r.x[:2] = torch.randn(2, 3)
    with pytest.warns(GraphDemotedWarning):
        out, _ = m.run(d.dispatch(2), 2)
    torch.testing.assert_close(out, r.x[:2] @ r.w)


def test_capture_on_steps_takes_the_wanted_item_first_and_runs_the_rest_eagerly():
    p, r, m = build(GraphMode.FULL)
    m.capture_on_steps()
    assert not p.graphs  # nothing captured up front
    r.x[:4] = torch.randn(4, 3)
    d4 = m.dispatcher.dispatch(3)
    eager = m.run(d4, 3).clone()  # not captured yet: eagerly
    assert m.stats().eager_steps and m.stats().replays == 0
    assert m.capture_next(d4)
    torch.testing.assert_close(m.run(d4, 3), eager)  # replayed now
    assert m.stats().replays == 1
    assert len(p.graphs) == 1 and r.steps[-1][1] is GraphMode.FULL  # size 4, first
    captured = 1
    while m.capture_next(d4):  # the rest, largest first
        captured += 1
    assert captured == 4 and len(p.graphs) == 4
    assert not m.capture_next()
    with pytest.raises(RuntimeError, match="already captures"):
        m.capture_on_steps()
    with pytest.raises(ValueError, match="resize"):
        m.resize((2, 8))


def test_a_failed_capture_on_steps_drops_the_plan_and_the_steps_run_eagerly():
    p, r, m = build(GraphMode.FULL)
    p.fail_capture = RuntimeError("no capture today")
    m.capture_on_steps()
    with pytest.raises(GraphCaptureError):
        m.capture_next()
    assert not m.capture_next()  # nothing left to try
    d = m.dispatcher.dispatch(2)
    m.run(d, 2)
    assert m.stats().replays == 0 and m.stats().eager == 1


@pytest.mark.parametrize("keep", [True, False])
def test_recapture_keeps_the_graph_keep_new_chooses_on_the_same_static_outputs(keep):
    # The engine captures a size again after measuring its kernel plans: the step now
    # computes otherwise; whichever graph stays writes where readers of the outputs read.
    p, r, m = build(GraphMode.FULL)
    m.capture()
    d = m.dispatcher.dispatch(4)
    static = m.run(d, 4).data_ptr()
    old_w = r.w.clone()
    r.w = torch.randn(3, 5)  # the new step's own weight: the old graph still reads old_w
    seen = []

    def keep_new(old, new, held):
        for replay in (old, new):
            replay()
            seen.append(m.outputs.view(4).clone())
        return keep

    before = len(p.graphs)
    assert m.recapture(d.descriptor, keep_new) is keep
    assert len(p.graphs) == before + 1 and p.graphs[-1].was_reset is not keep
    x = r.x[:4]
    torch.testing.assert_close(seen[0], x @ old_w)
    torch.testing.assert_close(seen[1], x @ r.w)
    r.x[:4] = torch.randn(4, 3)
    out = m.run(d, 4)
    assert out.data_ptr() == static
    torch.testing.assert_close(out, r.x[:4] @ (r.w if keep else old_w))
    assert m.stats().replays == 2  # the choice's replays are no steps


def test_a_held_recapture_lets_steps_run_between_its_parts_on_the_old_graph():
    # A background caller's recapture: the capture, each round of the choice and the swap
    # each hold the turn apart; between them steps replay the old graph, and each round
    # writes the dummy inputs again (a step wrote its own meanwhile).
    import contextlib

    p, r, m = build(GraphMode.FULL)
    m.capture()
    d = m.dispatcher.dispatch(4)
    old_w = r.w.clone()
    r.w = torch.randn(3, 5)
    log = []

    @contextlib.contextmanager
    def turn():
        log.append("turn")
        yield
        r.x[:4] = torch.randn(4, 3)  # a step between two holds: real inputs
        log.append(("step", torch.allclose(m.run(d, 4), r.x[:4] @ old_w)))

    def keep_new(old, new, held):
        for replay in (old, new):
            with held():
                replay()
                log.append(("round", len(r.prepared)))
        return True

    assert m.recapture(d.descriptor, keep_new, turn) is True
    rounds = [entry for entry in log if entry[0] == "round"]
    steps = [entry for entry in log if entry[0] == "step"]
    assert log.count("turn") == 4 and rounds[1][1] == rounds[0][1] + 1  # (one each)
    assert steps[:3] == [("step", True)] * 3  # the old graph until the swap
    r.x[:4] = torch.randn(4, 3)
    torch.testing.assert_close(m.run(d, 4), r.x[:4] @ r.w)  # the new one after it

    def failing(old, new, held):
        with held():
            raise RuntimeError("no verdict today")

    graphs = len(p.graphs)
    with pytest.raises(RuntimeError, match="no verdict"):
        m.recapture(d.descriptor, failing, turn)
    assert len(p.graphs) == graphs + 1 and p.graphs[-1].was_reset  # the new one destroyed
    r.x[:4] = torch.randn(4, 3)
    torch.testing.assert_close(m.run(d, 4), r.x[:4] @ r.w)  # the graph before kept


def test_a_held_recapture_warms_up_and_records_beside_the_steps_where_the_platform_records_apart():
    # CUDA records without running anything: with a warm_step (the step's work on inputs
    # of its own), a background recapture holds the turn only for its dummy inputs; steps
    # meanwhile replay the old graph, which stays in place until the swap.
    p, r, m = build(GraphMode.FULL)
    m.capture()
    d = m.dispatcher.dispatch(4)
    old_w = r.w.clone()
    r.w = torch.randn(3, 5)
    turn = FlaggedTurn()
    log = []

    def warm_step(desc):
        log.append(("warm", turn.held, m.ready(d)))
        return torch.zeros(desc.num_tokens, 3) @ r.w

    def prepare(desc):
        log.append(("prepare", turn.held))
        return r.prepare(desc)

    def step(desc):
        if p.capturing is not None:
            log.append(("record", turn.held, m.ready(d)))
        return r.step(desc)

    m.step, m.prepare, m.warm_step, p.records_apart = step, prepare, warm_step, True

    def keep_new(old, new, held_round):
        with held_round():
            new()
        return True

    assert m.recapture(d.descriptor, keep_new, turn) is True
    assert log[:4] == [("warm", False, True)] * 2 + [("prepare", True), ("record", False, True)]
    r.x[:4] = torch.randn(4, 3)
    torch.testing.assert_close(m.run(d, 4), r.x[:4] @ r.w)  # the new graph after the swap
    assert not torch.allclose(r.x[:4] @ old_w, r.x[:4] @ r.w)
    # Without recording apart, the warm-ups are the step's own, in the hold.
    p.records_apart, log[:] = False, []
    m.recapture(d.descriptor, keep_new, turn)
    assert ("prepare", True) in log and not any(e[0] == "warm" for e in log)
    assert [e for e in log if e[0] == "record"] == [("record", True, True)]


def test_a_held_recapture_never_drains_the_device_inside_the_turn_but_to_swap():
    # The dummy inputs are device work queued behind the steps' (one stream): a drain in
    # the hold would hold a step for the work queued before it as well (a recapture's
    # timed replay held the turn 3.6 ms on an H200 where a replay took about 1). CUDA
    # records apart, so its holds are the dummy inputs', each round's and the swap's.
    p, r, m = build(GraphMode.FULL)
    m.capture()
    d = m.dispatcher.dispatch(4)
    turn, log = FlaggedTurn(), []

    def keep_new(old, new, held_round):
        for replay in (old, new, old, new):
            with held_round():
                log.append(("round", turn.held))
                replay()
        return True

    p.synchronize = lambda: log.append(("drain", turn.held))
    p.records_apart = True
    m.warm_step = lambda desc: torch.zeros(desc.num_tokens, 3) @ r.w
    assert m.recapture(d.descriptor, keep_new, turn) is True
    assert log.count(("round", True)) == 4
    # The one drain in a hold: the swap's (the loser's replays end before its reset).
    assert [e for e in log if e == ("drain", True)] == [log[-1]] == [("drain", True)]


def test_a_failed_recapture_keeps_the_old_graph_and_an_unknown_size_is_named():
    p, r, m = build(GraphMode.FULL)
    m.capture()
    d = m.dispatcher.dispatch(2)
    p.fail_capture = RuntimeError("no capture today")
    with pytest.raises(GraphCaptureError):
        m.recapture(d.descriptor, lambda old, new, held: True)
    assert m.ready(d) and m.num_graphs == 4  # every size kept
    torch.testing.assert_close(m.run(d, 2), r.x[:2] @ r.w)
    with pytest.raises(KeyError, match="no FULL graph was captured"):
        m.recapture(BatchDescriptor(3), lambda old, new, held: True)
