"""The capture planner against brute force: on small cases every subset of sizes that
holds the largest and fits the budget is tried, and the planner's choice pads as little
as the best of them, within the budget; and its named errors."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ostinato.capture_planner import padded_rows, plan_capture_sizes


def brute_force(histogram, max_size, budget, cost):
    best = None
    for k in range(max_size):
        for rest in itertools.combinations(range(1, max_size), k):
            sizes = (*rest, max_size)
            if sum(cost[s] for s in sizes) <= budget:
                pad = padded_rows(histogram, sizes)
                best = pad if best is None else min(best, pad)
    return best


@st.composite
def cases(draw):
    max_size = draw(st.integers(1, 9))
    histogram = draw(st.dictionaries(st.integers(1, 12), st.integers(0, 50), max_size=9))
    # Costs that do not fall as sizes grow (a larger graph holds more activations).
    steps = draw(st.lists(st.integers(0, 5), min_size=max_size, max_size=max_size))
    cost = dict(enumerate(itertools.accumulate(s + 1 for s in steps), start=1))
    budget = draw(st.integers(cost[max_size], sum(cost.values()) + 3))
    return histogram, max_size, budget, cost


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_plan_pads_least_within_the_budget(case):
    histogram, max_size, budget, cost = case
    plan = plan_capture_sizes(histogram, max_size, budget, cost, granule=1)
    assert plan.sizes[-1] == max_size and plan.bytes <= budget
    assert plan.bytes == sum(cost[s] for s in plan.sizes)
    assert plan.padded_rows == padded_rows(histogram, plan.sizes)
    assert plan.padded_rows == brute_force(histogram, max_size, budget, cost)


def test_a_skewed_histogram_pads_less_than_powers_of_two_in_the_same_memory():
    # Most steps at 1..4 and 20..40 tokens (a decode-heavy server with some prefill).
    histogram = {s: 100 for s in range(1, 5)} | {s: 10 for s in range(20, 41)}
    powers = (1, 2, 4, 8, 16, 32, 64)
    plan = plan_capture_sizes(histogram, 64, len(powers) << 20, lambda s: 1 << 20)
    assert len(plan.sizes) <= len(powers) and plan.sizes[-1] == 64
    assert plan.padded_rows < padded_rows(histogram, powers) / 2
    assert plan.padding_fraction < 0.1


def test_the_budget_must_hold_the_largest_size():
    with pytest.raises(ValueError, match="do not hold even the largest size"):
        plan_capture_sizes({1: 5}, 8, 100, lambda s: 1000, granule=1)
    with pytest.raises(TypeError, match="histogram"):
        plan_capture_sizes([1, 2], 8, 100, lambda s: 1)
    with pytest.raises(TypeError, match="max_size"):
        plan_capture_sizes({1: 1}, "8", 100, lambda s: 1)
