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
