"""An engine's start leaves the heap it made frozen (``gc.freeze``: no later full
collection walks it), and its close makes that heap collectable again."""

import gc
import weakref

from ostinato.engine import LLM


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
