"""The load benchmark's metrics, computed from replies built by hand: TTFT, TPOT, ITL,
end-to-end latency and throughputs as the field defines them, and open-loop arrivals at
the rate asked."""

import math

import pytest

from benchmarks.serve_load import Reply, arrivals, cpu_set, distribution, summarize


def test_the_fields_metrics_from_replies_built_by_hand():
    # Request 0: sent at 0, tokens at 1.0 (2 of them), 1.5, 2.0 (1 each): 4 tokens.
    # Request 1: sent at 0.5, 1 token at 1.5, then hangs up (no TPOT, no latency).
    # Request 2: sent at 1.0, 3 tokens at 2.5 in one chunk.
    replies = [
        Reply(0, 0, [1, 2, 3, 4], 0.0, [(1.0, 2), (1.5, 1), (2.0, 1)], "length"),
        Reply(1, 1, [5], 0.5, [(1.5, 1)], None, hung_up=True),
        Reply(2, 2, [6, 7, 8], 1.0, [(2.5, 3)], "stop"),
    ]
    got = summarize(replies, closed_loop=False)
    assert got["wall_s"] == 2.5 and got["tokens"] == 8 and got["completed"] == 2
    assert got["output_throughput"] == pytest.approx(8 / 2.5)
    assert got["request_throughput"] == pytest.approx(2 / 2.5)
    assert sorted([got["ttft_ms"]["p50"], got["ttft_ms"]["mean"]]) == pytest.approx(
        [1000, (1000 + 1000 + 1500) / 3]
    )
    # TPOT: request 0 only (request 2's tokens all came with its first): 1000 ms / 2
    assert got["tpot_ms"] == {"mean": 500.0, "p50": 500.0, "p90": 500.0, "p99": 500.0}
    # ITL: request 0's gaps, one per token after the first chunk
    assert got["itl_ms"]["mean"] == pytest.approx(500.0)
    assert got["e2e_latency_ms"]["mean"] == pytest.approx((2000 + 1500) / 2)
    assert got["steady"] is None


def test_distribution_of_nothing_is_none():
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_arrivals_follow_the_rate_asked():
    times = arrivals(4000, 50.0, seed=1)
    assert times[0] == 0 and times == sorted(times)
    assert len(times) / times[-1] == pytest.approx(50.0, rel=0.05)
    assert arrivals(3, math.inf, seed=1) == [0.0, 0.0, 0.0]
    assert arrivals(5, 2.0, seed=3) == arrivals(5, 2.0, seed=3)  # seeded


def test_cpu_lists_read_as_taskset_writes_them():
    assert cpu_set("0-3,8") == frozenset({0, 1, 2, 3, 8})
    assert cpu_set(" 5 ") == frozenset({5})
    assert cpu_set("") is None
    for bad in ("a-3", "1-", "x"):
        with pytest.raises(ValueError, match="CPU list"):
            cpu_set(bad)


def test_the_first_token_split_is_each_histogram_s_mean_over_the_phase():
    from benchmarks.serve_load import first_token_split

    def scrape(sums, counts):
        names = ("time_to_first_token", "request_accept", "request_queue", "request_prefill")
        got = {f"ostinato_{n}_seconds_sum": s for n, s in zip(names, sums, strict=True)}
        return got | {f"ostinato_{n}_seconds_count": c for n, c in zip(names, counts, strict=True)}

    before = scrape([1.0, 0.5, 0.25, 0.25], [10, 10, 10, 10])
    after = scrape([1.1, 0.52, 0.29, 0.25], [14, 14, 12, 10])
    split = first_token_split(before, after)["first_token_split_ms"]
    assert split["server_ttft"] == pytest.approx(25.0) and split["accept"] == pytest.approx(5.0)
    assert split["queue"] == pytest.approx(20.0) and split["prefill"] is None  # none counted
    assert first_token_split({}, {})["first_token_split_ms"]["queue"] is None  # an older server


def test_a_phase_reads_the_http_process_s_cpu_seconds_and_full_collections():
    from benchmarks.serve_load import SERIES, graph_counters

    full = 'python_gc_collections_total{generation="2"}'
    before = {"process_cpu_seconds_total": 10.0, full: 3.0, "ostinato_engine_steps_total": 5.0}
    after = {"process_cpu_seconds_total": 12.5, full: 4.0, "ostinato_engine_steps_total": 9.0}
    got = graph_counters(before, after)
    assert got["server_cpu_s"] == 2.5 and got["server_full_collections"] == 1.0
    assert got["engine_steps"] == 4.0
    assert all(any(name.startswith(s) for s in SERIES) for name in after)


def test_a_phase_s_first_token_line_names_each_part_and_the_server_s_cpu():
    from benchmarks.serve_load import _split_line

    split = {"server_ttft": 9.04, "accept": 2.5, "queue": 0.25, "prefill": None}
    row = {"first_token_split_ms": split, "server": {"ttft_ms": {"mean": 20.0}}, "server_cpu": 0.5}
    assert _split_line(row) == (
        "clients 20.0: server_ttft 9.0 accept 2.5 queue 0.2 prefill -, server_cpu 0.50"
    )
    del row["server_cpu"]  # (a phase without engine steps)
    assert _split_line(row).endswith("prefill -")
