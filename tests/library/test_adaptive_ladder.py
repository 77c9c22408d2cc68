"""The adaptive ladder on the graph test double (each capture charges 1 KiB of pool):
between steps it moves a FULL ladder to the sizes that pad least for the traffic seen,
within the budget, never inside a step, a bounded number of times; replays stay right."""

import random

import pytest
import torch
from fakes import FakePlatform

from ostinato import Dispatcher, GraphConfig, GraphManager, GraphMode
from ostinato.adaptive_ladder import AdaptiveLadder, AdaptivePolicy
from ostinato.capture_planner import padded_rows

KIB = 1024
LADDER = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)


class Runner:
    def __init__(self):
        torch.manual_seed(0)
        self.x = torch.zeros(64, 4)  # [max tokens, 4]
        self.w = torch.randn(4, 3)

    def step(self, d):
        return self.x[: d.num_tokens] @ self.w


def manager(mode=GraphMode.FULL, sizes=LADDER):
    r = Runner()
    p = FakePlatform()
    m = GraphManager(
        r.step,
        Dispatcher(GraphConfig(mode=mode, capture_sizes=sizes)),
        platform=p,
        pool=1,
        progress=False,
    )
    m.capture()
    return r, p, m


def step(r, m, n):
    r.x[:n] = torch.randn(n, 4)
    out = m.run(m.dispatcher.dispatch(n), n)
    torch.testing.assert_close(out, r.x[:n] @ r.w)


def skewed(rng):
    """Most steps 1 to 4 or 20 to 40 tokens, a few up to 64."""
    roll = rng.random()
    if roll < 0.5:
        return rng.randint(1, 4)
    return rng.randint(20, 40) if roll < 0.95 else rng.randint(41, 64)


def test_the_ladder_moves_between_steps_only_within_budget_and_pads_less():
    r, p, m = manager()
    ladder = AdaptiveLadder(m, AdaptivePolicy(budget_bytes=7 * KIB, every=200, granule=KIB))
    rng = random.Random(0)
    for i in range(600):
        graphs = len(p.graphs)
        step(r, m, skewed(rng))
        assert len(p.graphs) == graphs, "nothing is captured inside a step"
        change = ladder.between_steps()
        if change is not None:
            assert (i + 1) % 200 == 0
    assert len(ladder.changes) >= 1
    first = ladder.changes[0]
    assert first.padded_after < first.padded_before and 64 not in first.dropped
    sizes = m.dispatcher.sizes
    assert len(sizes) * KIB <= 7 * KIB and sizes[-1] == 64
    assert m.num_graphs == len(sizes)  # dropped graphs are gone, added ones held
    histogram = m.stats().step_sizes
    assert padded_rows(histogram, sizes) < padded_rows(histogram, LADDER[:7] + (64,))
    for n in (1, 3, 21, 39, 64):  # replays of the moved ladder still compute the step
        step(r, m, n)


def test_moves_are_bounded_and_a_ladder_that_pads_nothing_stays():
    r, p, m = manager()
    policy = AdaptivePolicy(budget_bytes=4 * KIB, every=10, max_resizes=2, granule=KIB)
    ladder = AdaptiveLadder(m, policy)
    rng = random.Random(1)
    for i in range(300):
        step(r, m, rng.randint(1, 64) if (i // 50) % 2 else rng.randint(1, 8))
        ladder.between_steps()
    assert len(ladder.changes) <= 2
    r, p, m = manager(sizes=(1, 2, 4, 64))
    exact = AdaptiveLadder(m, AdaptivePolicy(budget_bytes=4 * KIB, every=5, granule=KIB))
    for _ in range(20):
        step(r, m, 2)
        assert exact.between_steps() is None


def test_resize_is_refused_where_it_cannot_hold():
    r, p, m = manager()
    with pytest.raises(ValueError, match="largest size must stay 64"):
        m.resize((1, 2, 32))
    r, p, m = manager(mode=GraphMode.FULL_AND_PIECEWISE, sizes=(1, 2, 4))
    with pytest.raises(ValueError, match="only a FULL-mode manager"):
        m.resize((1, 4))
    with pytest.raises(ValueError, match="budget_bytes"):
        AdaptivePolicy(budget_bytes=0)
    with pytest.raises(TypeError, match="budget_bytes"):
        AdaptivePolicy(budget_bytes=2.5)
    with pytest.raises(ValueError, match="min_gain"):
        AdaptivePolicy(budget_bytes=KIB, min_gain=1.5)


def test_a_failed_capture_leaves_the_old_ladder_whole():
    r, p, m = manager(sizes=(1, 8, 64))
    p.fail_capture = RuntimeError("planted")
    with pytest.raises(Exception, match="planted"):
        m.resize((1, 3, 64))
    assert m.dispatcher.sizes == (1, 8, 64) and m.num_graphs == 3
    p.fail_capture = None
    step(r, m, 5)
