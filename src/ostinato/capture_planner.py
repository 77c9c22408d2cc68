"""The capture planner: which sizes to capture, given how often each step size occurs and
what each graph costs in memory.

``plan_capture_sizes(histogram, max_size, budget_bytes, bucket_bytes)`` returns the set
of capture sizes that minimises the padded rows the histogram's steps compute, among all
sets that contain ``max_size`` (so every size up to it has a graph) and whose graphs fit
in the budget. Exact for the cost model it is given: each bucket adds its own bytes
(``bucket_bytes``: a function of the size, or the bytes measured per captured size, where
a size not measured costs what the next measured size above it did), rounded up to
``granule``; the sum must fit ``budget_bytes``.

Why it is exact and fast: an optimal set only ever places a bucket at a size that occurs
in the histogram, or at ``max_size`` (moving a bucket down to the largest occurring size
at or below it pads no more and, with costs that do not fall as sizes shrink, costs no
more), so a dynamic programme over those K sizes and the budget's granules,
O(K^2 x granules), finds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ostinato.capture_report import GraphRecord
from ostinato.mathutil import ceil_div, checked_int, is_int
from ostinato.modes import GraphMode

INFEASIBLE = 2**62  # (a sum of two stays below int64's limit)


@dataclass(frozen=True)
class CapturePlan:
    """The chosen sizes (ascending), the padded rows and real rows they give the
    histogram's steps (steps above ``max_size`` excluded: they run eagerly), and the
    bytes the cost model charges for them."""

    sizes: tuple[int, ...]
    padded_rows: int
    real_rows: int
    bytes: int

    @property
    def padding_fraction(self) -> float:
        """Share of the rows the graphs compute that are padding."""
        total = self.padded_rows + self.real_rows
        return self.padded_rows / total if total else 0.0


def padded_rows(histogram: Mapping[int, int], sizes: tuple[int, ...]) -> int:
    """Padding rows ``sizes`` give the histogram's steps (each padded to the smallest
    size that holds it; steps above the largest size are not counted)."""
    ordered = sorted(sizes)
    total = 0
    for size, count in histogram.items():
        bucket = next((b for b in ordered if b >= size), None)
        if bucket is not None:
            total += count * (bucket - size)
    return total


def plan_capture_sizes(
    histogram: Mapping[int, int],
    max_size: int,
    budget_bytes: int,
    bucket_bytes: Mapping[int, int] | Callable[[int], int],
    granule: int = 1 << 20,
) -> CapturePlan:
    """The sizes to capture (see the module docstring). ``ValueError`` if even
    ``max_size`` alone does not fit the budget, naming both numbers."""
    _check(histogram, max_size, budget_bytes, granule)
    cost = _measured(bucket_bytes) if isinstance(bucket_bytes, Mapping) else bucket_bytes
    seen = {s: c for s, c in histogram.items() if 1 <= s <= max_size and c > 0}
    candidates = sorted(set(seen) | {max_size})
    units = [ceil_div(int(cost(s)), granule) for s in candidates]
    budget = budget_bytes // granule
    if units[-1] > budget:
        raise ValueError(
            f"budget_bytes: {budget_bytes} bytes do not hold even the largest size "
            f"({max_size}: {cost(max_size)} bytes); raise the budget or lower max_size"
        )
    sizes = _solve(candidates, [seen.get(s, 0) for s in candidates], units, budget)
    real = sum(s * c for s, c in seen.items())
    spent = sum(int(cost(s)) for s in sizes)
    return CapturePlan(sizes, padded_rows(seen, sizes), real, spent)


def _solve(
    candidates: list[int], counts: list[int], units: list[int], budget: int
) -> tuple[int, ...]:
    """The dynamic programme: ``best[j, u]`` is the least padding of every step up to
    ``candidates[j]`` with a bucket there and ``u`` granules spent."""
    k = len(candidates)
    c = torch.tensor(candidates, dtype=torch.int64)
    n = torch.tensor(counts, dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)
    count_sum = torch.cat([zero, n.cumsum(0)])  # steps among the first i candidates
    size_sum = torch.cat([zero, (n * c).cumsum(0)])  # and their rows
    best = torch.full((k, budget + 1), INFEASIBLE, dtype=torch.int64)
    parent = torch.full((k, budget + 1), -1, dtype=torch.int64)
    start = torch.full((budget + 1,), INFEASIBLE, dtype=torch.int64)
    start[0] = 0  # nothing chosen yet, nothing spent
    for j in range(k):
        w = units[j]
        for i in range(-1, j):  # i: the bucket below this one (-1: none)
            steps = count_sum[j + 1] - count_sum[i + 1]
            pad = int(c[j] * steps - (size_sum[j + 1] - size_sum[i + 1]))
            before = start if i < 0 else best[i]
            shifted = torch.full((budget + 1,), INFEASIBLE, dtype=torch.int64)
            if w <= budget:
                shifted[w:] = before[: budget + 1 - w] + pad
            better = shifted < best[j]
            best[j][better] = shifted[better]
            parent[j][better] = i
    return _walk_back(candidates, units, best, parent)


def _walk_back(
    candidates: list[int], units: list[int], best: torch.Tensor, parent: torch.Tensor
) -> tuple[int, ...]:
    j = len(candidates) - 1
    u = int(torch.argmin(best[j]))  # least padding; the fewest granules among equals
    chosen = []
    while j >= 0:
        chosen.append(candidates[j])
        i = int(parent[j][u])
        u -= units[j]
        j = i
    return tuple(sorted(chosen))


def device_costs(records: Sequence[GraphRecord]) -> Callable[[int], int]:
    """What a FULL graph of each size costs the device, from capture records (a later
    record of a size replaces an earlier one): the pool growth measured at that size, or
    the next measured size above it, plus an even share of what the captures took
    beyond the pool. That share is the driver's memory for the graphs themselves: about
    a MiB each on the H200, too little for the driver's 2 MiB pages to show per graph,
    yet with dozens of graphs the larger part of what extra sizes cost."""
    latest = {r.descriptor.num_tokens: r for r in records if r.mode is GraphMode.FULL}
    if not latest:
        raise ValueError("records: no FULL graph was captured, so nothing was measured")
    pool = _measured({n: r.pool_bytes for n, r in latest.items()})
    beyond = sum(r.device_bytes for r in latest.values()) - sum(
        r.pool_bytes for r in latest.values()
    )
    per_graph = ceil_div(max(0, beyond), len(latest))
    return lambda size: pool(size) + per_graph


def _measured(measured: Mapping[int, int]) -> Callable[[int], int]:
    """Bytes per size from the sizes measured: a size not measured costs what the
    smallest measured size above it did (a larger graph holds at least as much)."""
    known = sorted(measured)

    def cost(size: int) -> int:
        above = next((k for k in known if k >= size), None)
        if above is None:
            raise ValueError(
                f"bucket_bytes: no measured size at or above {size} (measured: {known}); "
                "measure the largest size too"
            )
        return measured[above]

    return cost


def _check(histogram: object, max_size: object, budget_bytes: object, granule: object) -> None:
    if not isinstance(histogram, Mapping) or not all(
        is_int(s) and is_int(c) and c >= 0 for s, c in histogram.items()
    ):
        raise TypeError("histogram: expected a mapping of step size -> count (ints, counts >= 0)")
    checked_int("max_size", max_size)
    checked_int("granule", granule)
    checked_int("budget_bytes", budget_bytes, least=0)
