"""An engine's start leaves the heap it made frozen (``gc.freeze``: no later full
collection walks it), and its close makes that heap collectable again; ``quiet_start``
holds collections off over a start and freezes what it made."""

import gc
import weakref

import pytest
from collector import walked

from ostinato.engine import LLM
from ostinato.engine.core.heap import quiet_start


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_start_freezes_the_heap_and_close_lets_its_cycles_go():
    gc.collect()
    gc.unfreeze()
    before = Cycle()  # garbage left over from before the start: collected, not frozen
    dropped = weakref.ref(before)
    del before
    kept = Cycle()  # alive through the start: frozen with it
    kept_ref = weakref.ref(kept)
    llm = LLM("tiny", device="cpu", max_model_len=64, max_num_seqs=4, progress=False)
    assert dropped() is None, "the start froze garbage: it would never be collected"
    assert gc.get_freeze_count() > 0
    model = weakref.ref(llm.engine.parts.model)
    del kept
    gc.collect()
    assert kept_ref() is not None, "a full collection still walked the start's heap"
    assert model() is not None
    llm.close()
    assert kept_ref() is None and gc.get_freeze_count() == 0
    del llm
    gc.collect()
    assert model() is None


@pytest.fixture
def clean_collector():
    gc.collect()
    gc.unfreeze()
    gc.enable()
    yield
    gc.unfreeze()
    gc.enable()


def test_a_quiet_start_collects_its_garbage_once_and_freezes_what_lives(clean_collector):
    counts = []
    gc.callbacks.append(record := lambda phase, info: phase == "stop" and counts.append(1))
    try:
        with quiet_start():
            assert not gc.isenabled()
            garbage, kept = Cycle(), Cycle()
            dropped = weakref.ref(garbage)
            del garbage
            for _ in range(5000):  # allocations that would have run the collector
                Cycle()
            assert counts == [] and dropped() is not None
        assert len(counts) == 1, "one collection, at the end"
    finally:
        gc.callbacks.remove(record)
    assert gc.isenabled() and dropped() is None and gc.get_freeze_count() > 0
    assert not walked([kept]), "what lives on was not frozen"


def test_a_failed_quiet_start_freezes_nothing_and_an_inner_one_keeps_the_pause(clean_collector):
    with pytest.raises(RuntimeError, match="start failed"), quiet_start():
        raise RuntimeError("start failed")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with quiet_start():
        with quiet_start():
            pass
        assert not gc.isenabled(), "the inner block ended the outer one's pause"
    assert gc.isenabled()
    gc.disable()
    with quiet_start():
        pass
    assert not gc.isenabled(), "a collector that was off was turned on"


def test_a_build_s_quiet_start_ends_before_its_graphs_are_captured(clean_collector, monkeypatch):
    # A capture pauses and resumes the collector itself; a background capture thread would
    # otherwise see it off on entry and have it turned on under it when the build ends.
    from ostinato.engine.api import startup

    seen, capture = [], startup.capture

    def watched(*args):
        seen.append((gc.isenabled(), gc.get_freeze_count() > 0))
        return capture(*args)

    monkeypatch.setattr(startup, "capture", watched)
    llm = LLM("tiny", device="cpu", max_model_len=64, max_num_seqs=4, progress=False)
    llm.close()
    assert seen == [(True, True)]


def _collector_on() -> bool:
    return gc.isenabled()


class _SeesTheCollector:
    """Unpickles into whether the collector was on while it was unpickled (as a module's
    import would run, in a spawned worker's unpickling of its target)."""

    def __reduce__(self):
        return (_collector_on, ())


_calls: list[tuple] = []


def _target(*args) -> None:
    _calls.append((args, gc.isenabled(), gc.get_freeze_count() > 0))


def test_a_spawned_target_is_unpickled_without_collections_then_called(clean_collector):
    import pickle

    from ostinato.engine.core.heap import call_unpickled

    _calls.clear()
    call_unpickled(pickle.dumps((_target, (_SeesTheCollector(), "lead"))), "pipe", 7)
    assert _calls == [((False, "lead", "pipe", 7), True, True)], (
        "unpickled with the collector on, or called before its heap was frozen, or the "
        "arguments out of order"
    )


def test_the_worker_processes_target_imports_nothing_heavy():
    # The module a spawned worker's target names is imported before any code of ours runs,
    # with the collector on: it must not import torch.
    import subprocess
    import sys

    code = (
        "import sys, ostinato.engine.core.heap; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_build_s_last_freeze_holds_the_device_gate(clean_collector, monkeypatch):
    # A background thread may be capturing when the build ends; the collection before the
    # freeze runs finalizers (a tensor's, a graph's) that must not land inside its capture.
    import threading

    from ostinato.engine.api import startup
    from ostinato.platform import base

    held, freeze = [], startup.freeze_heap

    def watched() -> None:
        other = threading.Thread(target=lambda: held.append(not _try_gate(base._device_gate)))
        other.start()
        other.join()
        freeze()

    monkeypatch.setattr(startup, "freeze_heap", watched)
    llm = LLM("tiny", device="cpu", max_model_len=64, max_num_seqs=4, progress=False)
    llm.close()
    assert held == [True], "the build froze its heap with the device gate free"


def _try_gate(gate) -> bool:
    """Whether this thread could take ``gate`` at once (released again if so)."""
    if gate.acquire(blocking=False):
        gate.release()
        return True
    return False


def test_an_idle_freeze_runs_once_per_ask_at_idle_or_once_overdue(monkeypatch):
    from ostinato.engine.core import heap

    runs, now = [], [100.0]
    monkeypatch.setattr(heap, "freeze_heap", lambda: runs.append(now[0]))
    freeze = heap.IdleFreeze(clock=lambda: now[0])
    assert not freeze.at_idle() and runs == []  # nothing asked
    freeze.ask()
    now[0] += 5.0
    freeze.ask()  # (the same ask: its time stays the first's)
    freeze.between_steps()
    assert freeze.asked and runs == []  # not yet overdue
    assert freeze.at_idle() and runs == [105.0] and not freeze.asked
    assert not freeze.at_idle() and runs == [105.0]  # once per ask
    freeze.ask()
    now[0] += heap.OVERDUE_S + 0.1
    freeze.between_steps()
    assert runs == [105.0, now[0]] and not freeze.asked


def _ask_during_a_stream(llm, monkeypatch, overdue: bool) -> tuple[list[str], int]:
    """A generate of 8 tokens whose callback asks for the freeze at its third token (as a
    background start ending mid-stream would); returns what happened in order (a
    ``token`` per callback, ``freeze`` per freeze) and the tokens."""
    from ostinato.engine import SamplingParams
    from ostinato.engine.core import heap

    events: list[str] = []
    monkeypatch.setattr(heap, "freeze_heap", lambda: events.append("freeze"))
    freeze = llm.engine.runner.idle_freeze
    now = [0.0]
    freeze._clock = lambda: now[0]

    def on_token(i: int, token: int) -> None:
        events.append("token")
        if events.count("token") == 3:
            freeze.ask()
            now[0] += heap.OVERDUE_S + 1 if overdue else 0.0

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    out = llm.generate([[1, 2, 3, 4, 5]], params, on_token=on_token)
    return events, len(out[0].token_ids)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_freeze_asked_mid_stream_waits_for_the_engine_to_be_idle(monkeypatch, async_scheduling):
    # The freeze's collection holds the interpreter's lock: between two tokens of a stream
    # it was a 14 ms gap on an H200 host. Asked mid-stream, it runs once the last token is
    # out; asked before a call, before its first step.
    llm = LLM(
        "tiny", device="cpu", max_model_len=64, max_num_seqs=4, progress=False,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    try:
        events, n = _ask_during_a_stream(llm, monkeypatch, overdue=False)
        assert n == 8 and events == ["token"] * 8 + ["freeze"]
        llm.engine.runner.idle_freeze.ask()
        events, n = _ask_during_a_stream(llm, monkeypatch, overdue=False)
        assert events[0] == "freeze" and events[1:] == ["token"] * 8 + ["freeze"]
    finally:
        llm.close()


def test_an_overdue_freeze_runs_between_two_steps(monkeypatch):
    # An engine that is never idle still freezes what its start made, once overdue.
    llm = LLM("tiny", device="cpu", max_model_len=64, max_num_seqs=4, progress=False)
    try:
        events, n = _ask_during_a_stream(llm, monkeypatch, overdue=True)
        assert n == 8 and events.count("freeze") == 1
        assert events.index("freeze") < len(events) - 1  # before the last token
    finally:
        llm.close()


def test_wait_for_graphs_runs_the_asked_freeze_only_where_no_call_steps(monkeypatch):
    from ostinato.engine.core import heap

    runs = []
    llm = LLM("tiny", device="cpu", max_model_len=64, max_num_seqs=4, progress=False)
    monkeypatch.setattr(heap, "freeze_heap", lambda: runs.append(1))  # (after the start's)
    try:
        freeze = llm.engine.runner.idle_freeze
        freeze.ask()
        with llm.exclusive():  # (a server's loop, or a generate on another thread)
            assert llm.wait_for_graphs(0) and runs == [] and freeze.asked
        assert llm.wait_for_graphs(0) and runs == [1] and not freeze.asked
    finally:
        llm.close()
