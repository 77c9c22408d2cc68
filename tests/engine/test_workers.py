"""The engine's worker processes: when a worker counts as silent."""


def test_a_worker_is_silent_only_after_its_first_beat():
    # Injected times, no sleeping: a worker still importing torch on a busy machine has not
    # beaten yet and is not called silent however long that takes; one that beat and
    # stopped is, once past the bound.
    from ostinato.engine.parallel.workers import silent_for

    assert silent_for(0.0, now=1e6, stale_s=15.0) is None
    assert silent_for(100.0, now=110.0, stale_s=15.0) is None
    assert silent_for(100.0, now=115.0, stale_s=15.0) is None
    assert silent_for(100.0, now=116.5, stale_s=15.0) == 16.5
