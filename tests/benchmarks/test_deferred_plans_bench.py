"""The deferred-plans benchmark (``benchmarks/deferred_plans.py``) on the CPU (no
background capture there: every round of both starts is settled): its rounds and
document."""

import json
import sys

from benchmarks import deferred_plans


def test_rounds_of_both_starts_are_written(tmp_path, monkeypatch):
    out = tmp_path / "d.json"
    argv = ["x", "--out", str(out), "--model", "tiny", "--batch", "2", "--new-tokens", "4"]
    monkeypatch.setattr(sys, "argv", [*argv, "--rounds-after", "2"])
    deferred_plans.main()
    doc = json.loads(out.read_text())
    assert doc["first_start_deferred"] is False  # the CPU: nothing to measure
    for key in ("first_start", "later_start"):
        rounds = doc[key]
        assert len(rounds) == 2 and all(r["tokens_per_s"] > 0 and r["settled"] for r in rounds)
    assert doc["provenance"]["torch"] and doc["first_start_longest_hold"] is None  # (no thread)
    # Every round's longest wait between two tokens (4 tokens: 3 gaps, each a step).
    assert all(r["longest_gap_ms"] > 0 for r in doc["first_start"] + doc["later_start"])
    # ... and when it ended, on the log lines' clock.
    assert all(len(r["longest_gap_ended"]) == 12 for r in doc["first_start"])
    gaps = doc["first_start_longest_gaps_ms"]
    assert gaps["during"] is None and gaps["after"] == max(
        r["longest_gap_ms"] for r in doc["first_start"]
    )
    assert doc["later_start_longest_gap_ms"] == max(r["longest_gap_ms"] for r in doc["later_start"])
    # Each round's wait for its first token (its prefill step), the first round's left out.
    assert all(r["first_token_ms"] > 0 for r in doc["first_start"] + doc["later_start"])
    firsts = doc["first_start_longest_first_token_ms"]
    assert firsts == {"during": None, "after": doc["first_start"][1]["first_token_ms"]}


def test_the_longest_gap_is_found_with_the_clock_it_ended_at():
    import datetime

    wall = datetime.datetime(2026, 1, 2, 3, 4, 5, 678000).timestamp()
    stamps = [(1.0, wall - 3), (1.002, wall - 2), (1.010, wall), (1.011, wall + 1)]
    gap, ended = deferred_plans._longest_gap(stamps)
    assert round(gap, 6) == 8.0 and ended == "03:04:05.678"
    assert deferred_plans._longest_gap([(1.0, wall)]) == (0.0, "")


def test_the_longest_gaps_are_split_at_the_end_of_the_background_work():
    rounds = [
        deferred_plans.Round(0.0, 1.0, False, 9.0),
        deferred_plans.Round(1.0, 1.0, False, 4.0),
        deferred_plans.Round(2.0, 1.0, True, 2.0),
        deferred_plans.Round(3.0, 1.0, True, 3.0),
    ]
    assert deferred_plans.longest_gaps_ms(rounds) == {"during": 9.0, "after": 3.0}
    assert deferred_plans.longest_gaps_ms([]) == {"during": None, "after": None}


def test_the_longest_first_token_waits_leave_out_the_first_round():
    def round_(settled, first_token_ms):
        return deferred_plans.Round(0.0, 1.0, settled, 1.0, "", first_token_ms)

    rounds = [round_(False, 7000.0), round_(False, 40.0), round_(False, 12.0), round_(True, 5.0)]
    assert deferred_plans.longest_first_tokens_ms(rounds) == {"during": 40.0, "after": 5.0}
    assert deferred_plans.longest_first_tokens_ms(rounds[:1]) == {"during": None, "after": None}
