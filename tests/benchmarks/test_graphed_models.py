"""The graphed-models benchmark's stream and bookkeeping (the GPU runs measure)."""

import json
import random
import subprocess
import sys

import pytest

from benchmarks.graphed_models import batch_stream


def test_a_stream_of_distinct_sizes_calls_each_alike_often():
    stream = batch_stream(random.Random(3), 64, 32, 16)
    counts = {b: stream.count(b) for b in set(stream)}
    assert len(stream) == 64 and len(counts) == 16
    assert set(counts.values()) == {4} and all(1 <= b <= 32 for b in counts)
    assert stream != sorted(stream)  # (shuffled: no size's calls all in a row)
    assert len(set(batch_stream(random.Random(3), 10, 32, 16))) == 10  # fewer calls than sizes
    assert len(batch_stream(random.Random(3), 64, 32, 0)) == 64
    with pytest.raises(ValueError, match="--distinct: 40 sizes cannot be drawn from 1..32"):
        batch_stream(random.Random(3), 64, 32, 40)


def test_a_tiny_run_writes_a_row_per_system_with_what_each_left_allocated(tmp_path):
    out = tmp_path / "graphed.json"
    args = ["--tiny", "--models", "distilbert", "--systems", "eager,ostinato default"]
    args += ["--calls", "4", "--distinct", "2", "--repeats", "1", "--size-repeats", "1"]
    subprocess.run(
        [sys.executable, "-m", "benchmarks.graphed_models", *args, "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["system"] for r in rows] == ["eager", "ostinato default"]
    assert all(r["leftover_mib"] == 0.0 and len(r["median_ms_by_size"]) == 2 for r in rows)
