"""The switch interval's holders (``ostinato.switch_interval``): overlapping in any order,
the interval is the lowest held, and the first holder's 'before' comes back at the end."""

import itertools
import sys
import threading

import pytest

from ostinato import switch_interval


@pytest.fixture
def before():
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    yield 0.004
    sys.setswitchinterval(saved)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_overlapping_holders_end_in_any_order_and_put_back_the_first_ones_before(before, order):
    asked = [0.0005, 0.0002, 0.01]  # (the last above the interval before: no effect)
    for seconds in asked:
        switch_interval.lower(seconds)
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    held = list(asked)
    for i in order:
        switch_interval.restore(asked[i])
        held.remove(asked[i])
        want = min([before, *held])
        assert sys.getswitchinterval() == pytest.approx(want)
    assert sys.getswitchinterval() == pytest.approx(before)


def test_a_block_lets_go_when_it_raises(before):
    with pytest.raises(KeyError), switch_interval.lowered(0.0005):
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        raise KeyError("x")
    assert sys.getswitchinterval() == pytest.approx(before)


def test_threads_holding_at_once_leave_the_interval_as_they_found_it(before):
    start = threading.Barrier(8)

    def hold(seconds: float) -> None:
        start.wait()
        for _ in range(200):
            with switch_interval.lowered(seconds):
                assert sys.getswitchinterval() <= seconds + 1e-9

    threads = [threading.Thread(target=hold, args=(0.0001 * (i + 1),)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sys.getswitchinterval() == pytest.approx(before)


def test_a_restore_without_its_lower_and_a_bad_interval_are_refused(before):
    with pytest.raises(RuntimeError, match="without its lower"):
        switch_interval.restore(0.0003)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="seconds > 0"):
            switch_interval.lower(bad)
    assert sys.getswitchinterval() == pytest.approx(before)
