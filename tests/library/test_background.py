"""Background capture: graphs recorded on a thread while steps run, on the CPU with the
test double for graphs. Steps see correct outputs whether they ran eagerly or replayed,
sizes asked for are captured first, and a failure leaves the steps eager."""

import contextlib
import gc
import logging
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch
from fakes import FakePlatform, turn_free

from ostinato import (
    Dispatcher,
    EagerReason,
    GraphCaptureError,
    GraphConfig,
    GraphManager,
    GraphMode,
)
from ostinato.platform import exclusive_device

SIZES = (1, 2, 4, 8, 16)


class Runner:
    """Inputs in one persistent buffer; ``prepare`` writes dummy inputs into it, as a
    real runner's capture does, so a capture interleaved inside a step would show."""

    def __init__(self, capture_delay_s=0.0):
        self.x = torch.zeros(16, 4)  # [max_tokens, 4]
        self.w = torch.randn(4, 3)
        self.delay = capture_delay_s
        self.prepared: list[int] = []

    def prepare(self, d):
        self.prepared.append(d.num_tokens)
        self.x[: d.num_tokens] = 1e6  # dummy inputs
        time.sleep(self.delay)  # widen the window a race would need

    def step(self, d):
        return self.x[: d.num_tokens] @ self.w


def build(mode=GraphMode.FULL, delay=0.0, fail=None, verify=False, runner=None):
    p = FakePlatform(fail_capture=fail)
    r = runner if runner is not None else Runner(delay)
    dispatcher = Dispatcher(GraphConfig(mode=mode, capture_sizes=SIZES))
    m = GraphManager(
        r.step, dispatcher, prepare=r.prepare, platform=p, progress=False, verify_graphs=verify
    )
    return p, r, m, dispatcher


@pytest.fixture(scope="module", autouse=True)
def warm_imports():
    # The test double's first capture imports torch's tracing modules (a second or so,
    # with the import lock held); done here, it does not stall the first test's steps.
    build()[2].capture()


def serve(r, m, dispatcher, steps, seed=0, seen=None):
    """Steps of random sizes: each writes fresh inputs, runs, and checks the output
    against the same product computed by hand (replayed or eager alike). Returns, per
    step, whether it ran as dispatched; ``seen`` collects the graphs ready at each."""
    g = torch.Generator().manual_seed(seed)
    modes = []
    for _ in range(steps):
        n = int(torch.randint(1, 17, (1,), generator=g))
        x = torch.randn(n, 4, generator=g)
        with m.stepping():
            dispatch = dispatcher.dispatch(n)
            r.x[:n] = x
            modes.append(m.ready(dispatch))
            if seen is not None and m.background is not None:
                seen.add(m.background.captured)
            out = m.run(dispatch, n)
            torch.testing.assert_close(out, x @ r.w)
    return modes


def serve_while_capturing(r, m, dispatcher, capture, steps, seed, seen=None, limit_s=60.0):
    """``serve``'s ``steps``, then more in rounds of 20 until ``capture`` is done (within
    ``limit_s``): on a busy machine the capture thread may get no turn during the first
    ``steps``, and what the tests check is steps and the capture taking turns."""
    modes = serve(r, m, dispatcher, steps, seed, seen)
    deadline = time.monotonic() + limit_s
    more = 0
    while not capture.done and time.monotonic() < deadline:
        more += 1
        modes += serve(r, m, dispatcher, 20, seed + 1000 * more, seen)
    return modes


def step_at_one(r, m, dispatcher, hold_s=0.0):
    """One step of one token, its output checked, holding the turn ``hold_s`` longer;
    returns whether it replayed (its graph was ready)."""
    with m.stepping():
        dispatch = dispatcher.dispatch(1)
        ready = m.ready(dispatch)
        r.x[:1] = 2.0
        torch.testing.assert_close(m.run(dispatch, 1), r.x[:1] @ r.w)
        time.sleep(hold_s)
    return ready


def test_steps_run_correctly_while_the_graphs_are_captured():
    p, r, m, dispatcher = build(delay=0.002)
    go = threading.Event()
    capture = m.capture_in_background(prologue=lambda: go.wait(10))
    assert not any(serve(r, m, dispatcher, steps=20))  # nothing ready yet: all eager
    assert m.stats().eager_steps[EagerReason.NOT_CAPTURED_YET] == 20
    go.set()
    seen: set[int] = set()
    ran = serve_while_capturing(r, m, dispatcher, capture, steps=300, seed=1, seen=seen)
    stats = m.stats()
    assert stats.eager_steps[EagerReason.NOT_CAPTURED_YET] == 20 + ran.count(False)
    assert stats.replays == ran.count(True)
    assert capture.wait(10) and capture.error is None
    assert m.num_graphs == len(SIZES) and capture.captured == capture.total == len(SIZES)
    # Steps took turns with the capture: some ran with part of the ladder ready.
    assert any(0 < k < len(SIZES) for k in seen)
    replays = sum(g.replays for g in p.graphs)
    assert all(serve(r, m, dispatcher, steps=50, seed=2))
    assert sum(g.replays for g in p.graphs) == replays + 50
    assert "graphs ready" in capture.summary()


def test_no_item_starts_while_another_engine_holds_the_device_and_steps_go_on():
    # An engine being built holds the process's device (``exclusive_device``) until the
    # steps below have run: this engine's capture waits for it without holding the turn
    # its own steps need.
    p, r, m, dispatcher = build()
    building, built, served = threading.Event(), threading.Event(), []

    def build_elsewhere():
        with exclusive_device():
            building.set()
            built.wait(30)

    other = threading.Thread(target=build_elsewhere)
    other.start()
    try:
        assert building.wait(10)
        capture = m.capture_in_background()
        steps = threading.Thread(target=lambda: served.extend(serve(r, m, dispatcher, 30)))
        steps.start()
        steps.join(10)
        assert len(served) == 30 and not any(served)  # every step ran, eagerly
        assert capture.captured == 0
    finally:
        built.set()
        other.join()
    assert capture.wait(10) and capture.captured == len(SIZES)


def test_sizes_a_step_asked_for_are_captured_first():
    p, r, m, dispatcher = build()
    go = threading.Event()
    capture = m.capture_in_background(prologue=lambda: go.wait(10))
    for n in (3, 1):  # pads to 4, then 1: neither is ready, both run eagerly
        with m.stepping():
            dispatch = dispatcher.dispatch(n)
            assert not m.ready(dispatch)
            m.run(dispatch, n)
    go.set()
    assert capture.wait(10)
    assert r.prepared[:2] == [4, 1] and sorted(r.prepared) == sorted(SIZES)


@pytest.mark.parametrize("hold_s", [0.0, 0.1])
def test_steps_replaying_back_to_back_hold_off_the_rest_of_the_plan(hold_s, monkeypatch):
    # Steps at size 1 run eagerly until its graph is captured (they asked for it), then
    # replay it back to back: meanwhile no other item takes the turn from them, whether
    # each holds the turn briefly or longer than the pause (an eager step on a GPU
    # holds it for milliseconds). Once they pause, the rest of the plan is captured.
    # (A pause of 200 ms, not 5, and no forced item: a busy test machine may stall this
    # thread between steps, or take long to reach the loop.)
    import ostinato.background as background

    monkeypatch.setattr(background, "PAUSE_S", 0.2)
    monkeypatch.setattr(background, "MAX_WAIT_S", 60.0)
    p, r, m, dispatcher = build()
    go = threading.Event()
    capture = m.capture_in_background(prologue=lambda: go.wait(10))

    def step():
        return step_at_one(r, m, dispatcher, hold_s)

    step()
    go.set()
    deadline = time.monotonic() + 10
    while not step():
        assert time.monotonic() < deadline
    assert r.prepared == [1]
    until = time.monotonic() + 0.5
    replays = 0
    while time.monotonic() < until:
        replays += step()
    assert replays >= 4 and r.prepared == [1] and not capture.done
    assert capture.wait(10) and capture.error is None  # the steps paused
    assert sorted(r.prepared) == sorted(SIZES)


def test_steps_that_never_pause_still_let_the_plan_finish(monkeypatch):
    # Back-to-back steps at a captured size hold the rest of the plan off, but for at
    # most MAX_WAIT_S an item: the plan, and whatever comes after it, finishes.
    import ostinato.background as background

    monkeypatch.setattr(background, "MAX_WAIT_S", 0.05)
    p, r, m, dispatcher = build()
    capture = m.capture_in_background()
    deadline = time.monotonic() + 10
    while not capture.done:  # steps at size 1 with no pause between them
        step_at_one(r, m, dispatcher)
        assert time.monotonic() < deadline, capture.summary()
    assert capture.error is None and sorted(r.prepared) == sorted(SIZES)


def test_items_beside_the_steps_under_steps_that_never_pause_wait_as_their_holds_are_short():
    # Items that warm up and record beside the steps (the platform records apart, a
    # warm_step given) hold the turn briefly: under steps that never pause each waits
    # UNIT_SPACING times the last one's hold (at least PAUSE_S, at most MAX_WAIT_S), so
    # they follow each other closely, where one a MAX_WAIT_S took the plan seconds.
    import ostinato.background as background

    p, r, m, dispatcher = build()
    p.records_apart, m.warm_step = True, lambda d: r.step(d)
    waits = []
    real = background.BackgroundCapture._await_pause

    def await_pause(self, max_wait=background.MAX_WAIT_S):
        waits.append(max_wait)
        return real(self, max_wait)

    background.BackgroundCapture._await_pause = await_pause
    try:
        start = time.monotonic()
        capture = m.capture_in_background()
        while not capture.done:  # steps with no pause between them (no outputs read:
            with m.stepping():  # this test double runs what it records, beside them)
                time.sleep(0.001)
            assert time.monotonic() - start < 30, capture.summary()
    finally:
        background.BackgroundCapture._await_pause = real
    assert capture.error is None and sorted(r.prepared) == sorted(SIZES)
    longest = capture.holds["captures"].longest
    assert waits[0] == background.MAX_WAIT_S  # (before the first item: no hold yet)
    assert all(w <= max(background.PAUSE_S, background.UNIT_SPACING * longest) for w in waits[1:])
    assert max(waits[1:]) < background.MAX_WAIT_S, (waits, longest)


@contextlib.contextmanager
def steps_that_never_pause(r, m, dispatcher):
    """Inside, a thread steps at size 1 with no pause between its steps."""
    stop = threading.Event()

    def steps():
        while not stop.is_set():
            step_at_one(r, m, dispatcher)

    stepper = threading.Thread(target=steps)
    stepper.start()
    try:
        yield
    finally:
        stop.set()
        stepper.join()


def test_short_units_under_steps_that_never_pause_come_often_long_ones_rarely():
    # After the plan, units wait for a pause at most UNIT_SPACING times the last unit's
    # hold: short ones (a measurement split into many) finish in a fraction of the
    # MAX_WAIT_S each that long ones wait, and the turn stays mostly the steps'.
    import ostinato.background as background

    p, r, m, dispatcher = build()
    started, held = [], []

    def afterwards(unit):
        with steps_that_never_pause(r, m, dispatcher):
            for hold_s in [0.002] * 20 + [0.2]:
                with unit():
                    started.append(time.monotonic())
                    time.sleep(hold_s)
                    held.append(hold_s)

    capture = m.capture_in_background(afterwards=afterwards)
    assert capture.wait(30) and capture.error is None and capture.afterwards_error is None
    assert len(held) == 21
    short = started[20] - started[0]  # 20 short units (each waited MAX_WAIT_S before)
    assert short < 20 * background.MAX_WAIT_S / 4, short


def test_the_epilogue_s_short_units_under_steps_that_never_pause_come_often():
    # The epilogue's units are paced as the units after it: under steps that never
    # pause, a short unit waits UNIT_SPACING times the last one's hold, not MAX_WAIT_S
    # (the engine's 21 sampling graphs, a few ms each, kept the graphs unready 20 s).
    import ostinato.background as background

    p, r, m, dispatcher = build()
    started = []

    def epilogue(unit):
        with steps_that_never_pause(r, m, dispatcher):
            for _ in range(21):
                with unit():
                    started.append(time.monotonic())
                    time.sleep(0.002)

    capture = m.capture_in_background(epilogue=epilogue)
    assert capture.wait(30) and capture.error is None
    assert len(started) == 21 and capture.holds["the epilogue"].count == 21
    short = started[20] - started[1]  # (the first waited for a hold to pace by)
    assert short < 20 * background.MAX_WAIT_S / 4, short


def test_a_failed_capture_leaves_the_steps_eager_and_says_why(caplog):
    p, r, m, dispatcher = build(fail=GraphCaptureError("device said no"))
    with caplog.at_level(logging.WARNING):
        capture = m.capture_in_background()
        assert capture.wait(10)
    assert isinstance(capture.error, GraphCaptureError) and m.num_graphs == 0
    assert "background capture failed" in caplog.text and "device said no" in caplog.text
    assert not any(serve(r, m, dispatcher, steps=20))  # every step eager, and correct
    assert "steps run eagerly" in capture.summary()


def test_release_stops_the_capture_thread():
    p, r, m, dispatcher = build(delay=0.05)
    capture = m.capture_in_background()
    time.sleep(0.06)
    m.release()
    assert capture.done and capture.captured < len(SIZES) and m.num_graphs == 0
    assert not any(serve(r, m, dispatcher, steps=5))


def test_piecewise_sizes_become_ready_as_they_are_captured():
    p, r, m, dispatcher = build(GraphMode.PIECEWISE)
    capture = m.capture_in_background()
    assert capture.wait(10) and capture.error is None
    assert all(m.ready(dispatcher.dispatch(n)) for n in (1, 5, 16))


def test_refused_twice_and_with_verify_graphs():
    _, _, m, _ = build(verify=True)
    with pytest.raises(ValueError, match="verify_graphs"):
        m.capture_in_background()
    _, _, m, _ = build()
    m.capture_in_background().wait(10)
    with pytest.raises(RuntimeError, match="already captures"):
        m.capture_in_background()


def test_work_afterwards_runs_after_the_epilogue_one_unit_per_turn_and_steps_stay_correct():
    # The engine measures its kernel plans there: each unit clobbers the persistent
    # inputs (as a timing or a recapture does) and must never land inside a step.
    p, r, m, dispatcher = build()
    order, units = [], []

    def afterwards(unit):
        order.append("afterwards")
        for _ in range(30):
            with unit():
                units.append(m.background.done)
                r.x[:] = -1e6  # a unit's own writes
                time.sleep(0.001)

    capture = m.capture_in_background(
        epilogue=lambda unit: order.append("epilogue"), afterwards=afterwards
    )
    ran = serve_while_capturing(r, m, dispatcher, capture, steps=300, seed=3)  # checks each
    assert capture.wait(10) and capture.error is None and capture.afterwards_error is None
    assert order == ["epilogue", "afterwards"] and units == [False] * 30
    assert capture.capture_seconds <= capture.seconds and "done after" in capture.summary()
    assert any(ran)


def test_the_epilogue_holds_the_turn_only_inside_its_units_and_steps_run_between():
    # The engine compiles the sampling graphs' kernels outside the units (seconds a step
    # must not wait), then captures one size's graphs per unit.
    p, r, m, dispatcher = build()
    order = []

    def step_meanwhile() -> threading.Event:
        stepped = threading.Event()

        def step():
            with m.stepping():
                stepped.set()

        threading.Thread(target=step).start()
        return stepped

    def epilogue(unit):
        order.append(m.num_graphs)
        assert step_meanwhile().wait(5), "a step waited for the turn outside the units"
        for i in range(3):
            with unit():
                held_back = step_meanwhile()
                assert not held_back.wait(0.05), "a step ran inside a unit"
                order.append(i)
            assert held_back.wait(5), "the held-back step did not run after the unit"

    capture = m.capture_in_background(epilogue=epilogue)
    assert capture.wait(10) and capture.error is None, capture.summary()
    assert order == [len(SIZES), 0, 1, 2]
    assert capture.holds["the epilogue"].count == 3


def test_an_epilogue_unit_lets_a_recording_apart_run_beside_the_steps():
    # The sampling graphs record inside the epilogue's units with the turn let go
    # (``graph.recorded_apart``): a step runs while one records, and the unit's hold does
    # not count that time. Outside a unit a recording apart records in place.
    from ostinato.graph import recorded_apart

    p, r, m, dispatcher = build()
    free: list[bool] = []
    spans: list[float] = []

    def epilogue(unit):
        with recorded_apart():
            pass  # (no unit: nothing to let go)
        start = time.perf_counter()
        with unit():
            free.append(turn_free(m))
            with recorded_apart():
                free.append(turn_free(m))
                time.sleep(0.4)
            free.append(turn_free(m))
        spans.append(time.perf_counter() - start)

    capture = m.capture_in_background(epilogue=epilogue)
    assert capture.wait(10) and capture.error is None, capture.summary()
    assert free == [False, True, False], free
    held = capture.holds["the epilogue"].longest
    assert held <= spans[0] - 0.4, (held, spans)  # (the time apart is no hold)


@pytest.mark.parametrize("slow", ["epilogue", "unit", "item"])
def test_the_longest_hold_of_the_turn_is_timed_and_named(slow):
    # What a step arriving at the wrong moment waits for: the bound is one replay.
    p, r, m, dispatcher = build()
    # (Half a second: above any other hold on a busy 2-core machine.)
    pause = lambda part: time.sleep(0.5 if part == slow else 0)  # noqa: E731

    def afterwards(unit):
        for _ in range(3):
            with unit():
                pause("unit")

    real = m._capture_one

    def capture_one(item, apart):
        pause("item" if item.descriptor.num_tokens == 4 else "")
        real(item, apart)

    m._capture_one = capture_one

    def epilogue(unit):
        with unit():
            pause("epilogue")

    capture = m.capture_in_background(epilogue=epilogue, afterwards=afterwards)
    assert capture.wait(10) and capture.afterwards_error is None
    hold = capture.longest_hold
    assert hold is not None and 0.5 <= hold.seconds < 5, hold
    names = {
        "epilogue": "the epilogue",
        "unit": "a unit after the capture: test_background.afterwards",  # (who took it)
        "item": "num_tokens=4",
    }
    assert names[slow] in hold.what, hold
    assert f"up to {1e3 * hold.seconds:.1f} ms ({hold.what})" in capture.summary()
    # Every hold tallied by kind: each capture, the epilogue, the units by their taker.
    tally = capture.holds
    assert sorted(tally) == ["captures", "test_background.afterwards", "the epilogue"], tally
    assert tally["captures"].count == len(SIZES) and tally["test_background.afterwards"].count == 3
    assert max(t.longest for t in tally.values()) == hold.seconds
    assert tally["the epilogue"].seconds <= tally["the epilogue"].longest * 1.0001


@pytest.mark.parametrize("apart", [True, False])
def test_a_full_graph_records_beside_the_steps_where_the_platform_records_apart(apart):
    # CUDA records without running anything: the steps need not wait for the recording,
    # only for the dummy inputs and the warm-up. (The test double runs what it records,
    # so no step runs here while it does: a thread only takes the turn.)
    p, r, m, dispatcher = build()
    p.records_apart = apart
    took: list[bool] = []  # per capture: whether a step took the turn inside it
    real = p.capture

    @contextlib.contextmanager
    def capture(graph, pool):
        stepper = threading.Thread(target=step)
        stepper.start()
        stepper.join(0.5)  # (with the turn held, it waits for the item's end)
        took.append(not stepper.is_alive())
        time.sleep(0.3)
        with real(graph, pool):
            yield

    def step():
        with m.stepping():
            pass

    p.capture = capture
    background = m.capture_in_background()
    assert background.wait(30) and background.error is None
    assert background.captured == len(SIZES) == len(m.report.records)
    assert took == [apart] * len(SIZES), took  # the step ran inside the recording
    # A hold is the item less its time apart: here the recording's 0.8 s.
    longest = background.holds["captures"].longest
    assert (longest < 0.3) if apart else (longest >= 0.8), longest
    assert all(serve(r, m, dispatcher, 20))  # every size replays, correctly


def test_a_warm_up_on_inputs_apart_runs_beside_the_steps_and_prepare_holds_the_turn():
    # With a warm_step (the step's work on inputs no step touches), a FULL item holds the
    # turn only for prepare's dummy inputs: its warm-up and its recording run beside the
    # steps. The steps' own ``step`` then runs only inside the recordings.
    p = FakePlatform()
    p.records_apart = True
    r = Runner()
    w = torch.zeros(16, 4)  # the warm-up's own inputs
    free: dict[str, list[bool]] = {"warm": [], "prepare": [], "step": []}

    free_now = lambda: turn_free(m)  # noqa: E731

    def warm_step(d):
        free["warm"].append(free_now())
        time.sleep(0.3)
        return w[: d.num_tokens] @ r.w

    def prepare(d):
        free["prepare"].append(free_now())
        r.prepare(d)

    def step(d):
        free["step"].append(p.capturing is not None)  # (only recorded)
        return r.step(d)

    dispatcher = Dispatcher(GraphConfig(mode=GraphMode.FULL, capture_sizes=SIZES))
    m = GraphManager(
        step, dispatcher, prepare=prepare, warm_step=warm_step, platform=p, progress=False
    )
    background = m.capture_in_background()
    assert background.wait(30) and background.error is None
    assert background.captured == len(SIZES)
    assert free == {"warm": [True] * 5, "prepare": [False] * 5, "step": [True] * 5}, free
    assert background.holds["captures"].longest < 0.6  # (prepare's 0.3 s wait, not the warm-up's)
    assert all(serve(r, m, dispatcher, 20))
    # Without the platform's recording apart, the warm-up is the step's own, in the turn.
    p2, r2, m2, d2 = build()
    m2.warm_step = lambda d: pytest.fail("warmed up beside the steps")
    assert m2.capture_in_background().wait(30) and m2.num_graphs == len(SIZES)


def endless(started: threading.Event, units: list):
    """An ``afterwards`` that takes one unit after another until the thread is stopped
    (``started`` set at its start, ``units`` counting them)."""

    def afterwards(unit):
        started.set()
        while True:
            with unit():
                units.append(1)
            time.sleep(0.001)

    return afterwards


def test_a_failure_afterwards_keeps_the_graphs_and_a_stop_ends_it(caplog):
    p, r, m, dispatcher = build()

    def failing(unit):
        with unit():
            raise RuntimeError("plans said no")

    with caplog.at_level(logging.WARNING):
        capture = m.capture_in_background(afterwards=failing)
        assert capture.wait(10)
    assert capture.error is None and isinstance(capture.afterwards_error, RuntimeError)
    assert m.num_graphs == len(SIZES) and all(serve(r, m, dispatcher, steps=10))
    assert "plans said no" in caplog.text and "plans said no" in capture.summary()

    p, r, m, dispatcher = build()
    started, units = threading.Event(), []
    capture = m.capture_in_background(afterwards=endless(started, units))
    assert started.wait(10)
    m.release()
    assert capture.done and capture.afterwards_error is None and units


def test_a_device_sync_beside_another_threads_capture_waits_for_its_end():
    # CUDA fails a capture when another thread synchronizes the whole device meanwhile (a
    # second engine's compile-ahead broke the first's background capture on an H200);
    # the synchronize of background work waits for the capture in progress instead.
    p, other = FakePlatform(), FakePlatform()
    capturing, release, order = threading.Event(), threading.Event(), []

    def capture_elsewhere():
        with other.capture(other.new_graph(), None):
            capturing.set()
            release.wait(30)
            order.append("capture ended")

    thread = threading.Thread(target=capture_elsewhere)
    thread.start()
    try:
        assert capturing.wait(10)
        with pytest.raises(RuntimeError, match="during another thread's capture"):
            p.synchronize()  # (what the fake, as CUDA, refuses)
        waiter = threading.Thread(
            target=lambda: (p.synchronize_outside_capture(), order.append("synchronized"))
        )
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and order == []
    finally:
        release.set()
        thread.join(10)
    waiter.join(10)
    assert order == ["capture ended", "synchronized"]


def test_a_timing_with_a_turn_captures_outside_it_and_holds_it_per_replay(monkeypatch):
    # Over 60 lines: the stand-ins for CUDA's graph, events and the turn are what the
    # assertions read, in one place.
    # graph_call_us with a turn: the captures (which run nothing) outside the step turn;
    # one held replay of one call first says how many calls fit HELD_REPLAY_US; then each
    # timed replay queued in a hold of its own, behind a spin queued in the same hold, and
    # waited for after it (no drain inside it); the spin and the timed events run once
    # before any hold (their first launch loads them); more replays where a graph holds
    # fewer calls; the median over them; and not through
    # ``torch.cuda.graph``, which empties the device's caches at every capture. The CUDA
    # calls are stand-ins here (the GPU test: test_gpu_core's
    # test_a_timing_held_per_replay_captures_...).
    from ostinato.platform import cuda

    # A call of 200 µs: two of the four fit 500 µs; twice the replays, of two calls each.
    replays = [400.0, 800.0, 100.0, 300.0, 500.0, 700.0, 900.0, 200.0, 600.0, 1000.0]
    log, held, times = [], [False], iter([0.0, 200.0, *replays])

    class Graph:
        def capture_begin(self, pool, capture_error_mode):
            log.append(("capture", held[0]))

        def capture_end(self):
            pass

        def replay(self):
            log.append(("replay", held[0]))

    class Event:
        def __init__(self, enable_timing):
            self.t = 0.0

        def record(self):
            log.append(("record", held[0]))

        def synchronize(self):
            log.append(("wait", held[0]))

        def elapsed_time(self, end):
            return next(times) / 1e3  # ms

    def graph(*args, **kwargs):
        raise AssertionError("torch.cuda.graph: it empties the caches")

    @contextlib.contextmanager
    def turn():
        held[0] = True
        log.append(("turn", True))
        yield
        held[0] = False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append(("drain", held[0])))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "_TIMING_WARM", set())
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("spin", held[0])))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "_side_stream", lambda: None)
    monkeypatch.setattr(cuda, "HELD_REPLAY_US", 500.0)
    calls = []
    us = cuda.graph_call_us(lambda: calls.append(1), 4, replays=5, turn=turn)
    assert us == 550.0 / 2 and len(calls) == 1 + 2  # the median replay, per call
    captures = [e for e in log if e[0] == "capture"]
    assert captures == [("capture", False)] * 2
    warm = [("record", False), ("spin", False), ("record", False), ("wait", False)]
    first_turn = log.index(("turn", True))
    assert log[:first_turn].count(("spin", False)) == 1 and warm == [
        e for e in log[:first_turn] if e[0] != "capture" and e[0] != "drain"
    ]
    holds = [log[i + 1 : i + 6] for i, entry in enumerate(log) if entry[0] == "turn"]
    assert len(holds) == 1 + 10
    assert all(h == [("spin", True), ("record", True), ("replay", True), ("record", True),
                     ("wait", False)] for h in holds)  # fmt: skip
    assert log.count(("spin", False)) == 1 and ("drain", True) not in log
    size = len(log)
    assert cuda.held_calls(lambda: None, 1, turn) == 1  # one call: nothing to measure
    assert len(log) == size


@dataclass
class FakeTimingCuda:
    """What the stand-ins for CUDA's pools, graphs and events recorded: pools made and
    freed, captures (with their pool), keeper kernels, ends of routing; ``fails`` holds
    the errors the next captures' ends raise; ``device`` the current device (set it to
    move)."""

    log: list = field(default_factory=list)
    fails: list = field(default_factory=list)
    device: int = 0

    @staticmethod
    def opened(n: int) -> list:
        """A pool made, its keeper graph captured into it and its one kernel."""
        return [("pool", (0, n)), ("capture", (0, n)), ("keeper",)]


@pytest.fixture
def fake_timing_cuda(monkeypatch) -> FakeTimingCuda:
    from ostinato.platform import cuda

    fake, ids = FakeTimingCuda(), iter(range(1, 100))
    log = fake.log

    class Pool:
        def __init__(self):
            self.id = (0, next(ids))
            log.append(("pool", self.id))

        def __del__(self):
            log.append(("freed", self.id))

    class Graph:
        def capture_begin(self, pool, capture_error_mode):
            log.append(("capture", pool))

        def capture_end(self):
            if fake.fails:
                raise RuntimeError(fake.fails.pop())

        def replay(self):
            pass

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 1.0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "MemPool", Pool)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("keeper",)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.device)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "_side_stream", lambda: None)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda d, p: log.append(("end", p)))
    return fake


# Each timing graph in a pool of its own left its memory cached once deleted (41 GiB over
# the 8 B shape's GEMM plans): inside ``timing_pool`` every capture of the thread goes to
# one pool per device, made at its first capture there, held by a keeper graph of one
# kernel captured first (PyTorch 2.11 asserts at a capture into a pool whose graphs all
# went), and dropped (its memory freed) once, when the outermost one ends. The CUDA calls
# are stand-ins here (the GPU test: test_gpu_core's
# test_a_measurements_timing_graphs_leave_about_one_graphs_memory_behind).


def test_a_measurements_timing_graphs_share_one_pool_freed_at_its_end(fake_timing_cuda):
    # ... and a graph_call_us outside any pool has a pool of its own, dropped as it returns.
    from ostinato.platform import cuda

    log, opened = fake_timing_cuda.log, fake_timing_cuda.opened
    with cuda.timing_pool():
        cuda.graph_call_us(lambda: None, 2)
        with cuda.timing_pool():
            cuda.captured_calls(lambda: None, 1)
        cuda.graph_call_us(lambda: None, 2)
        assert log == [*opened(1), *[("capture", (0, 1))] * 3]
    assert log[-1] == ("freed", (0, 1)) and len(log) == 7
    log.clear()
    cuda.graph_call_us(lambda: None, 2)
    assert log == [*opened(2), ("capture", (0, 2)), ("freed", (0, 2))]
    log.clear()
    cuda.captured_calls(lambda: None, 1)  # outside any: a pool of its own
    assert log[-1] == ("capture", None)


def test_a_timing_capture_that_fails_to_end_leaves_its_pool_for_a_fresh_one(fake_timing_cuda):
    from ostinato.platform import cuda

    log, opened = fake_timing_cuda.log, fake_timing_cuda.opened
    with cuda.timing_pool():
        cuda.captured_calls(lambda: None, 1)
        fake_timing_cuda.fails.append("capture failed")
        with pytest.raises(RuntimeError, match="capture failed"):
            cuda.captured_calls(lambda: None, 1)
        cuda.captured_calls(lambda: None, 1)
    failed = [("capture", (0, 1)), ("end", (0, 1)), ("freed", (0, 1))]
    assert log == [*opened(1), ("capture", (0, 1)), *failed, *opened(2), ("capture", (0, 2)),
                   ("freed", (0, 2))]  # fmt: skip


def test_a_timing_pool_is_made_per_device_at_its_first_capture_there(fake_timing_cuda):
    # An engine measures on its own device (``torch.cuda.device``), not always the
    # current one.
    from ostinato.platform import cuda

    fake = fake_timing_cuda
    log, opened = fake.log, fake.opened
    with cuda.timing_pool():
        assert log == []
        fake.device = 1
        cuda.captured_calls(lambda: None, 1)
        fake.device = 0
        cuda.captured_calls(lambda: None, 1)
        fake.device = 1
        cuda.captured_calls(lambda: None, 1)
    assert log == [*opened(1), ("capture", (0, 1)), *opened(2), ("capture", (0, 2)),
                   ("capture", (0, 1)), ("freed", (0, 1)), ("freed", (0, 2))]  # fmt: skip


def test_the_collector_runs_on_beside_the_steps_through_the_plan_and_what_follows():
    # Paused for the whole start (about a minute on a GPU), every thread's garbage piled
    # up, and the first collection after it held every step 17-35 ms on an H200 host.
    # Each capture still pauses it: the platforms' ``capture``, not this double's.
    seen = []

    class Recording(Runner):
        def prepare(self, d):
            seen.append(gc.isenabled())  # on the capture thread, before each capture
            super().prepare(d)

    p, r, m, dispatcher = build(runner=Recording())

    def afterwards(unit):
        with unit():
            seen.append(gc.isenabled())

    capture = m.capture_in_background(afterwards=afterwards)
    serve_while_capturing(r, m, dispatcher, capture, steps=50, seed=5)
    assert capture.wait(10) and capture.error is None and capture.afterwards_error is None
    assert len(seen) == len(SIZES) + 1 and all(seen) and gc.isenabled()


def test_settle_runs_last_without_the_turn_before_done_once_and_not_after_a_stop(caplog):
    # The engine collects and freezes its heap there: what the thread made lives as long
    # as the graphs, and every later full collection would walk it again.
    p, r, m, dispatcher = build()
    order, seen = [], []

    def afterwards(unit):
        with unit():
            order.append("afterwards")

    def settle():
        order.append("settle")
        seen.append((m.background.done, turn_free(m), m.num_graphs))

    capture = m.capture_in_background(
        epilogue=lambda unit: order.append("epilogue"), afterwards=afterwards, settle=settle
    )
    assert capture.wait(10) and capture.error is None
    assert order == ["epilogue", "afterwards", "settle"]
    assert seen == [(False, True, len(SIZES))]

    p, r, m, dispatcher = build()

    def failing():
        raise RuntimeError("no heap today")

    with caplog.at_level(logging.WARNING):
        capture = m.capture_in_background(settle=failing)
        assert capture.wait(10)
    assert capture.error is None and "no heap today" in caplog.text
    assert m.num_graphs == len(SIZES) and all(serve(r, m, dispatcher, steps=10))

    p, r, m, dispatcher = build()
    started, settled = threading.Event(), []
    capture = m.capture_in_background(
        afterwards=endless(started, []), settle=lambda: settled.append(1)
    )
    assert started.wait(10)
    m.release()
    assert capture.done and not settled


def test_the_manager_keeps_its_capture_before_the_thread_runs(monkeypatch):
    # A step that asks for the turn once the thread runs must find it: the thread's start
    # is held here until its prologue has looked (under load it had run before the manager
    # kept the capture, and a step there would have taken no turn).
    p, r, m, dispatcher = build()
    looked, seen = threading.Event(), []
    start = threading.Thread.start

    def held_start(thread):
        start(thread)
        if thread.name == "ostinato-capture":
            looked.wait(5)

    def prologue():
        seen.append(m.background is not None)
        looked.set()

    monkeypatch.setattr(threading.Thread, "start", held_start)
    capture = m.capture_in_background(prologue)
    assert capture.wait(10) and capture.error is None
    assert seen == [True], "the thread ran before the manager kept its capture"
