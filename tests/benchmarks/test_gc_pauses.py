import gc
import threading

from benchmarks.gc_pauses import watch


def test_a_collection_over_the_threshold_is_recorded_with_its_generation_and_thread():
    before = list(gc.callbacks)
    pauses = watch(over_ms=-1.0)  # (every collection)
    try:
        gc.collect(1)
        worker = threading.Thread(target=gc.collect, name="collector")
        worker.start()
        worker.join()
    finally:
        gc.callbacks[:] = before
    seen = [(p.generation, p.thread) for p in pauses]
    assert (1, "MainThread") in seen and (2, "collector") in seen, seen
    assert all(p.ms >= 0 and p.collected >= 0 for p in pauses)
    quiet = watch(over_ms=1e9)
    try:
        gc.collect()
    finally:
        gc.callbacks[:] = before
    assert quiet == []


def test_a_threshold_that_is_not_a_number_is_refused_by_name(capsys):
    import pytest

    from benchmarks.gc_pauses import main

    before = list(gc.callbacks)
    with pytest.raises(SystemExit):
        main(["--over", "x", "benchmarks.deferred_plans"])
    assert "argument --over: invalid float value: 'x'" in capsys.readouterr().err
    assert gc.callbacks == before  # (nothing watched)
