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
