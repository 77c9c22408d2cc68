"""The graph-budget benchmark's planning, from measured bytes (the GPU part measures)."""

from benchmarks.graph_budget import compare_ladders, skewed_histogram
from ostinato.capture_planner import padded_rows
from ostinato.config import default_capture_sizes


def test_both_plans_beat_the_default_on_its_own_terms():
    default = tuple(default_capture_sizes(64))

    def cost(n):  # grows with the size
        return (1 << 20) + n * (24 << 10)

    histogram = skewed_histogram(5000, 64)
    assert sum(c for n, c in histogram.items() if n <= 4 or 20 <= n <= 40) > 0.9 * 5000
    base, same_memory, same_padding = compare_ladders(histogram, cost, default)
    assert base.name == "default" and base.charged_bytes == sum(map(cost, default))
    assert same_memory.charged_bytes <= base.charged_bytes
    assert same_memory.padded_rows <= base.padded_rows
    assert same_padding.padded_rows <= base.padded_rows
    assert same_padding.charged_bytes <= same_memory.charged_bytes
    for ladder in (same_memory, same_padding):
        assert ladder.sizes[-1] == 64
        assert padded_rows(histogram, ladder.sizes) == ladder.padded_rows
