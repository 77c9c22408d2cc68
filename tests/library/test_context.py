import threading

import pytest

from ostinato import (
    BatchDescriptor,
    GraphMode,
    current_forward_context,
    forward_context,
    get_forward_context,
)


def test_nesting_and_restore():
    assert current_forward_context() is None
    d = BatchDescriptor(8)
    with forward_context(GraphMode.FULL, d, attn_metadata="m") as outer:
        assert get_forward_context() is outer
        assert outer.batch_descriptor == d and outer.attn_metadata == "m"
        with forward_context(GraphMode.NONE) as inner:
            assert get_forward_context() is inner
        assert get_forward_context() is outer
    assert current_forward_context() is None


def test_restored_after_error():
    with pytest.raises(KeyError), forward_context(GraphMode.PIECEWISE, BatchDescriptor(1)):
        raise KeyError("x")
    assert current_forward_context() is None


def test_get_without_context_says_how_to_fix():
    with pytest.raises(RuntimeError, match="forward_context"):
        get_forward_context()


def test_only_runtime_modes():
    with pytest.raises(ValueError, match="not a runtime mode"):
        forward_context(GraphMode.FULL_AND_PIECEWISE)


def test_threads_do_not_see_each_others_context():
    seen = []
    with forward_context(GraphMode.FULL, BatchDescriptor(4)):
        t = threading.Thread(target=lambda: seen.append(current_forward_context()))
        t.start()
        t.join()
    assert seen == [None]
