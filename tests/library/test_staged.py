"""Staged graphs on the CPU with the test double for graphs: steps served by the first
stage from the start, buckets moved to the upgrade only where measured faster and only
between steps, and every failure of the upgrade leaving the first stage serving."""

import gc
import logging
import threading

import pytest
import torch
from fakes import FakePlatform, capture_threads, turn_free

from ostinato import GraphConfig, GraphMode, StagedRuntime, build_graph_runtime

SIZES = (1, 2, 4, 8, 16)


class Runner:
    """Inputs in one persistent buffer, as a model runner's; the two stages compute the
    same product through different step functions, counted apart."""

    def __init__(self):
        self.x = torch.zeros(16, 4)
        self.w = torch.randn(4, 3)
        self.calls = {"first": 0, "upgrade": 0}

    def prepare(self, d):
        self.x[: d.num_tokens] = 1e6  # dummy inputs

    def step_as(self, stage):
        def step(d):
            self.calls[stage] += 1
            return self.x[: d.num_tokens] @ self.w

        step.stage = stage
        return step


def runtime(r, stage, mode, platform):
    config = GraphConfig(mode=mode, capture_sizes=SIZES)
    pool = platform.graph_pool_handle()  # the upgrade's own pool
    return build_graph_runtime(
        r.step_as(stage),
        config,
        prepare=r.prepare,
        platform=platform,
        progress=False,
        pool=pool,
        piecewise_available=True,
        max_num_reqs=max(SIZES),
    )


def fast_below(rows):
    """A timer (after running the step) under which the upgrade is twice as fast up to
    ``rows`` rows and 10% slower above."""

    def timed(rt, dispatch, n, meta):
        rt.manager.run(dispatch, n, meta, record=False)  # (as wall_timer)
        if rt.manager.step.stage == "first":
            return 1.0
        return 0.5 if n <= rows else 1.1

    return timed


def staged(r, platform=None, upgrade_platform=None, build=None, **kw):
    platform = platform or FakePlatform()
    first = runtime(r, "first", GraphMode.FULL, platform)
    first.manager.capture()
    up = upgrade_platform or platform
    return StagedRuntime(first, build or (lambda: runtime(r, "upgrade", GraphMode.FULL, up)), **kw)


def serve(r, s, steps, seed=0):
    """Steps of random sizes, each checked against the product by hand; returns the
    stages they ran on."""
    g = torch.Generator().manual_seed(seed)
    stages = []
    for _ in range(steps):
        n = int(torch.randint(1, 17, (1,), generator=g))
        x = torch.randn(n, 4, generator=g)
        with s.stepping():
            d = s.dispatch(n, uniform_decode=bool(n % 2))
            r.x[:n] = x
            stages.append(s.routes(d))
            out = s.run(d, n)
            torch.testing.assert_close(out, x @ r.w)
    return stages


def test_buckets_move_to_the_upgrade_only_where_it_measured_faster():
    r = Runner()
    s = staged(r, timer=fast_below(4), repeats=3)
    serve(r, s, 40)  # served while the upgrade proceeds, correct on either stage
    assert s.wait(30) and s.error is None, s.summary()
    assert s.decisions  # every bucket of the upgrade's plan was measured
    for key, decision in s.decisions.items():
        assert decision.upgraded == (key.num_tokens <= 4), decision
        assert (key in s.upgraded) == decision.upgraded
    before = dict(r.calls)
    stages = serve(r, s, 40, seed=1)
    assert any(stages) and not all(stages)
    assert r.calls["upgrade"] >= before["upgrade"]
    assert "buckets measured faster and moved" in s.summary()
    s.release()


def test_the_upgrade_thread_leaves_the_collector_running_and_collects_nothing(monkeypatch):
    # Beside the caller's calls: a pause of the whole upgrade would pile up every thread's
    # garbage for one long collection after it, and a full collection holds every thread.
    collects = []
    real = gc.collect

    def collect(*args):
        if threading.current_thread() is not threading.main_thread():
            collects.append(args)
        return real(*args)

    monkeypatch.setattr(gc, "collect", collect)
    seen, timer = [], fast_below(4)

    def timed(*args):
        seen.append(gc.isenabled())  # on the upgrade's thread, after each capture
        return timer(*args)

    r = Runner()
    s = staged(r, timer=timed, repeats=1)
    serve(r, s, 20)
    assert s.wait(30) and s.error is None, s.summary()
    assert seen and all(seen) and not collects
    s.release()


def test_a_slower_upgrade_moves_nothing():
    r = Runner()
    s = staged(r, timer=fast_below(0))
    assert s.wait(30) and s.error is None
    assert s.decisions and not s.upgraded
    assert not any(serve(r, s, 20))
    s.release()


def test_routing_changes_only_between_steps():
    # While a step holds its turn, the thread can neither capture, measure nor move a
    # bucket: the table seen at dispatch is the table at the step's end.
    r = Runner()
    s = staged(r, timer=fast_below(16), repeats=1)
    seen = []
    while not s.done:
        with s.stepping():
            before = (s.upgraded, len(s.decisions), s.upgrade is not None)
            threading.Event().wait(0.01)
            seen.append(before == (s.upgraded, len(s.decisions), s.upgrade is not None))
    assert all(seen) and s.error is None and s.upgraded
    s.release()


def test_the_buckets_steps_use_are_upgraded_first():
    r = Runner()
    go = threading.Event()
    platform = FakePlatform()

    def build():
        go.wait(10)
        return runtime(r, "upgrade", GraphMode.FULL, platform)

    s = staged(r, platform, build=build, timer=fast_below(16), repeats=1)
    for _ in range(5):
        with s.stepping():
            d = s.dispatch(8, uniform_decode=True)
            s.run(d, 8)
    go.set()
    assert s.wait(30) and s.error is None
    assert next(iter(s.decisions)) == s.first.dispatch(8, uniform_decode=True).descriptor
    s.release()


def test_a_decode_moves_to_the_upgrades_decode_graph_a_mixed_step_to_its_pieces():
    # FULL serves a uniform decode from a mixed batch's graph; FULL_AND_PIECEWISE from a
    # decode graph of its own, and a mixed step from pieces. Each of the upgrade's buckets
    # is measured against the first stage's for the steps it serves, and moves alone:
    # here its decode graphs measure faster and its pieces slower.
    r = Runner()
    platform = FakePlatform()

    def timed(rt, dispatch, n, meta):
        rt.manager.run(dispatch, n, meta, record=False)  # (as wall_timer)
        if rt.manager.step.stage == "first":
            return 1.0
        return 0.5 if dispatch.descriptor.uniform_decode else 2.0

    def build():
        return runtime(r, "upgrade", GraphMode.FULL_AND_PIECEWISE, platform)

    s = staged(r, platform, build=build, timer=timed, repeats=1)
    serve(r, s, 20)
    assert s.wait(30) and s.error is None, s.summary()
    kinds = {d.uniform_decode for d in s.decisions}
    assert kinds == {True, False}  # the decode graphs and the pieces, each measured
    for d, decision in s.decisions.items():
        assert decision.upgraded == d.uniform_decode, decision
        assert decision.first == s.first.dispatch(d.num_tokens, d.uniform_decode).descriptor
    for n in SIZES:
        decode, mixed = s.dispatch(n, uniform_decode=True), s.dispatch(n, uniform_decode=False)
        assert s.routes(decode) and decode.descriptor.uniform_decode
        assert decode.descriptor in s.upgraded
        assert not s.routes(mixed) and mixed == s.first.dispatch(n)
    stages = serve(r, s, 40, seed=3)  # each step checked against the product by hand
    assert any(stages) and not all(stages)  # (serve: odd sizes decode, even ones mixed)
    s.release()


@pytest.mark.parametrize("where", ["build", "capture", "memory"])
def test_a_failed_upgrade_leaves_the_first_stage_serving(where, caplog):
    r = Runner()
    kw = {"timer": fast_below(16), "repeats": 1}
    if where == "build":
        kw["build"] = lambda: (_ for _ in ()).throw(RuntimeError("the compiler failed"))
        want = "the compiler failed"
    elif where == "capture":
        kw["upgrade_platform"] = FakePlatform(fail_capture=RuntimeError("capture broke"))
        want = "capture broke"
    else:
        kw["memory_budget"] = 1500  # the test double's captures cost 1 KiB each
        want = "planned for them"
    with caplog.at_level(logging.WARNING, logger="ostinato.staged"):
        s = staged(r, **kw)
        serve(r, s, 20)
        assert s.wait(30)
    assert s.error is not None and want in str(s.error)
    assert s.upgrade is None and not s.upgraded
    assert "the first stage serves" in caplog.text and want in caplog.text
    assert not any(serve(r, s, 20, seed=2))
    s.release()


def test_bad_settings_name_themselves():
    r = Runner()
    with pytest.raises(ValueError, match="repeats >= 1"):
        staged(r, repeats=0)
    with pytest.raises(ValueError, match="memory_budget >= 0"):
        staged(r, memory_budget=-1)


def built(s):
    """Waits (at most 30 s: a busy machine) until an on_steps upgrade's thread has built
    it and ended."""
    for _ in range(3000):
        if s.upgrade is not None and not s._thread.is_alive():
            return
        threading.Event().wait(0.01)


class CountingLock:
    def __init__(self):
        self.entered = 0

    def acquire(self, blocking=True):
        self.entered += 1
        return True

    def release(self):
        return None


def test_on_steps_the_thread_only_builds_and_each_advance_captures_one_bucket_here():
    # on_steps: the thread builds the upgrade and captures nothing; each advance() (a
    # step's, under the device lock) captures and measures one bucket on the calling
    # thread; wait() advances through the rest. Measurement runs are not counted as steps.
    r, up, lock = Runner(), FakePlatform(), CountingLock()
    captured_on = capture_threads(up)
    s = staged(r, upgrade_platform=up, timer=fast_below(4), on_steps=True, device_lock=lock)
    built(s)
    assert s.upgrade is not None and not captured_on and not s.done
    replays = s.first.manager.stats().replays
    s.advance()
    assert len(captured_on) == 1 and len(s.decisions) == 1 and lock.entered == 1
    assert s.first.manager.stats().replays == replays  # (the measurement's runs)
    serve(r, s, 5)  # steps between advances run as ever
    assert s.wait(30) and s.error is None, s.summary()
    assert set(captured_on) == {threading.current_thread()}
    assert len(s.decisions) == len(SIZES) and lock.entered == len(SIZES)
    assert {d.num_tokens for d in s.upgraded} == {1, 2, 4}
    s.advance()  # done: nothing more
    assert lock.entered == len(SIZES)
    s.release()


def test_a_ctrl_c_inside_an_advance_ends_the_upgrade_and_reaches_the_caller():
    # on_steps: the caller's thread captures, so its KeyboardInterrupt must not be taken
    # for the upgrade's failure and swallowed; the first stage serves on.
    r = Runner()

    def interrupted(rt, dispatch, n, meta):
        raise KeyboardInterrupt

    s = staged(r, timer=interrupted, on_steps=True)
    built(s)
    with pytest.raises(KeyboardInterrupt):
        s.advance()
    assert s.done and isinstance(s.error, KeyboardInterrupt) and s.upgrade is None
    assert not any(serve(r, s, 5))
    s.release()


def test_wait_takes_the_device_lock_before_the_turn_as_a_steps_advance_does():
    # A step on another thread holds the device lock and then wants the turn (its
    # advance); wait() on this thread must not hold the turn while it waits for the lock.
    r, lock = Runner(), threading.RLock()
    s = staged(r, timer=fast_below(4), on_steps=True, device_lock=lock)
    built(s)
    inside = threading.Event()

    def step():
        with lock:
            inside.set()
            threading.Event().wait(0.3)  # (the waiter reaches its lock meanwhile)
            with s.stepping():
                pass

    stepper = threading.Thread(target=step, daemon=True)
    stepper.start()
    assert inside.wait(5)
    waiter = threading.Thread(target=s.wait, args=(30,), daemon=True)
    waiter.start()
    stepper.join(30)
    waiter.join(30)
    assert not stepper.is_alive() and not waiter.is_alive(), "deadlock"
    assert s.done and s.error is None, s.summary()
    s.release()


@pytest.mark.parametrize("on_steps", [False, True])
def test_settle_runs_once_last_without_the_turn_before_done(on_steps):
    # The engine collects and freezes its heap there: what the upgrade made lives as long
    # as its graphs. On the thread, or with on_steps on the thread of the last advance.
    r, seen = Runner(), []

    def settle():
        seen.append((s.done, len(s.decisions), turn_free(s), threading.current_thread()))

    s = staged(r, timer=fast_below(4), repeats=1, on_steps=on_steps, settle=settle)
    assert s.wait(30) and s.error is None, s.summary()
    assert len(seen) == 1
    done, decided, free, thread = seen[0]
    assert not done and decided == len(SIZES) and free
    assert (thread is threading.current_thread()) == on_steps
    s.release()
    assert len(seen) == 1


def test_settle_runs_not_after_a_failure_or_a_stop_and_its_own_failure_is_logged(caplog):
    r, settled = Runner(), []

    def broken():
        raise RuntimeError("the compiler failed")

    s = staged(r, build=broken, settle=lambda: settled.append(1))
    assert s.wait(30) and s.error is not None and not settled
    s.release()
    started = threading.Event()

    def slow():
        started.set()
        threading.Event().wait(0.5)  # (released meanwhile)
        return runtime(r, "upgrade", GraphMode.FULL, FakePlatform())

    s = staged(r, build=slow, timer=fast_below(4), settle=lambda: settled.append(1))
    assert started.wait(10)
    s.release(30)
    assert not settled

    def failing():
        raise RuntimeError("no heap today")

    with caplog.at_level(logging.WARNING, logger="ostinato"):
        s = staged(r, timer=fast_below(4), repeats=1, settle=failing)
        assert s.wait(30)
    assert s.error is None and s.upgraded and "no heap today" in caplog.text
    s.release()
