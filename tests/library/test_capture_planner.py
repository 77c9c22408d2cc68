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


def test_device_costs_charge_the_pool_measured_above_and_an_even_share_of_the_rest():
    from ostinato.batch import BatchDescriptor
    from ostinato.capture_planner import device_costs
    from ostinato.capture_report import GraphRecord
    from ostinato.modes import GraphMode

    def record(n, pool, device, mode=GraphMode.FULL):
        return GraphRecord(BatchDescriptor(n), mode, pool, device, 0.1)

    mib = 1 << 20
    # Largest first: it grows the pool; the others reuse it, and the driver's memory for
    # the graphs shows in 2 MiB pages only now and then.
    records = [record(64, 34 * mib, 36 * mib), record(32, 0, 2 * mib), record(8, 0, 0)]
    records.append(record(8, 0, 2 * mib, GraphMode.PIECEWISE))  # not a FULL graph: ignored
    cost = device_costs(records)
    share = (38 - 34) * mib // 3 + 1  # rounded up
    assert cost(64) == 34 * mib + share and cost(48) == 34 * mib + share
    assert cost(32) == cost(3) == share
    records.append(record(32, mib, mib))  # a later capture of 32 replaces the first
    assert device_costs(records)(20) == mib + (37 - 35) * mib // 3 + 1
    with pytest.raises(ValueError, match="no measured size at or above 65"):
        cost(65)
    with pytest.raises(ValueError, match="no FULL graph"):
        device_costs([records[3]])
