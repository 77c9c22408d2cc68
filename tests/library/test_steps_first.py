"""Steps first: a thread beside the steps waits at its pause points while a step holds
the step turn, and nowhere else (``ostinato.steps_first``, ``Turn.wait_while_stepping``)."""

import threading
import time

import pytest
import torch
from fakes import FakePlatform

from ostinato import Dispatcher, GraphConfig, GraphManager, GraphMode, background
from ostinato.background import Turn
from ostinato.steps_first import beside, pause_point, unpaused

HOLD_S = 0.3


@pytest.fixture(autouse=True)
def long_bound(monkeypatch):
    # Each test's steps hold the turn for HOLD_S, past the bound on one wait.
    monkeypatch.setattr(background, "STEP_WAIT_S", 10.0)


def hold_the_turn(turn: Turn, holding: threading.Event, hold_s: float = HOLD_S) -> list[float]:
    """Starts a step on a thread that holds ``turn`` for ``hold_s`` (``holding`` set once
    it has it); the list gets the time it let go."""
    released: list[float] = []

    def step() -> None:
        with turn:
            holding.set()
            time.sleep(hold_s)
            released.append(time.monotonic())

    threading.Thread(target=step, daemon=True).start()
    assert holding.wait(10)
    return released


def test_a_thread_beside_the_steps_waits_at_a_pause_point_until_the_step_lets_go():
    turn, holding = Turn(), threading.Event()
    released = hold_the_turn(turn, holding)
    with beside(turn):
        pause_point()
    returned = time.monotonic()
    assert released and returned >= released[0]


def test_a_pause_point_off_the_threads_beside_the_steps_returns_at_once():
    turn, holding = Turn(), threading.Event()
    released = hold_the_turn(turn, holding)
    start = time.monotonic()
    pause_point()  # (this thread said nothing: a step's own launches pass)
    assert time.monotonic() - start < HOLD_S / 3 and not released


def test_a_pause_point_inside_a_recording_returns_at_once():
    # A platform's capture is unpaused: a pause there would keep the capture open while
    # the steps run (their freed blocks not reused until it ends).
    turn, holding = Turn(), threading.Event()
    released = hold_the_turn(turn, holding)
    start = time.monotonic()
    with beside(turn), unpaused():
        pause_point()
    assert time.monotonic() - start < HOLD_S / 3 and not released
    with beside(turn):
        pause_point()  # (outside the recording it waits again)
    assert released


def test_a_pause_point_with_no_step_holding_the_turn_returns_at_once():
    turn = Turn()
    start = time.monotonic()
    with beside(turn):
        for _ in range(1000):
            pause_point()
    assert time.monotonic() - start < 0.5


def test_the_thread_holding_the_turn_passes_its_own_pause_points():
    # A thread beside the steps that takes the turn as a step does (a staged upgrade
    # installing its graphs) must not wait for itself.
    turn = Turn()
    start = time.monotonic()
    with beside(turn), turn, turn:
        pause_point()
        with turn.capturing():
            pause_point()
    assert time.monotonic() - start < 0.5


def test_a_pause_is_bounded_should_the_step_never_let_go(monkeypatch):
    monkeypatch.setattr(background, "STEP_WAIT_S", 0.05)
    turn, holding = Turn(), threading.Event()
    released = hold_the_turn(turn, holding, hold_s=2.0)
    start = time.monotonic()
    with beside(turn):
        pause_point()
    waited = time.monotonic() - start
    assert 0.04 <= waited < 1.0 and not released


def prologue_beside_a_step(eager: bool) -> tuple[float, float]:
    """A background capture of sizes 1 and 2 whose prologue calls ``pause_point()`` while
    a step holds the turn for ``HOLD_S`` (``eager``: having first run size 2 eagerly, its
    graph still to capture); returns when the pause point returned and when the step let
    go of the turn."""
    x, w = torch.zeros(16, 4), torch.randn(4, 3)
    dispatcher = Dispatcher(GraphConfig(mode=GraphMode.FULL, capture_sizes=(1, 2)))
    m = GraphManager(
        lambda d: x[: d.num_tokens] @ w, dispatcher, platform=FakePlatform(), progress=False
    )
    holding, returned = threading.Event(), []

    def prologue() -> None:
        assert holding.wait(10)
        pause_point()
        returned.append(time.monotonic())

    capture = m.capture_in_background(prologue=prologue)
    with m.stepping():
        if eager:
            dispatch = dispatcher.dispatch(2)
            assert not m.ready(dispatch)
            m.run(dispatch, 2)
        holding.set()
        time.sleep(HOLD_S)
        released = time.monotonic()
    assert capture.wait(30) and capture.error is None
    m.release()
    assert returned
    return returned[0], released


def test_a_background_capture_thread_pauses_while_a_step_holds_the_turn():
    # The capture thread runs beside the steps: its prologue's pause point waits out a
    # step that holds the turn (the engine's kernel launches call it: test_triton_launch).
    returned, released = prologue_beside_a_step(eager=False)
    assert returned >= released


def test_a_step_that_runs_eagerly_lets_the_thread_beside_it_go_on():
    # An eager step holds the turn for milliseconds and the thread's work (its graph) is
    # what speeds it up: the thread does not wait it out.
    turn, holding, eager, released = Turn(), threading.Event(), threading.Event(), []

    def step() -> None:
        with turn:
            holding.set()
            assert eager.wait(10)
            turn.step_runs_eagerly()
            time.sleep(HOLD_S)
            released.append(time.monotonic())

    threading.Thread(target=step, daemon=True).start()
    assert holding.wait(10)
    with beside(turn):
        waiter = threading.Timer(0.05, eager.set)
        waiter.start()
        pause_point()  # (waits for the step, until it says it runs eagerly)
    assert eager.is_set() and not released
    with beside(turn):
        pause_point()
    assert not released  # (the same hold: still eager)


def test_the_capture_thread_goes_on_beside_a_step_at_a_size_still_to_capture():
    returned, released = prologue_beside_a_step(eager=True)
    assert returned < released
