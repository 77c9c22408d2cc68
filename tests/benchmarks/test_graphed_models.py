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


def test_the_leftover_probe_reads_the_live_blocks_with_frames_largest_first():
    from benchmarks.graphed_leftover import live_blocks

    def frame(name):
        return {"filename": f"/x/site-packages/torch/{name}.py", "line": 3, "name": name}

    snapshot = {
        "segments": [
            {"stream": 7, "blocks": [
                {"state": "active_allocated", "size": 2**20, "frames": [frame("a")]},
                {"state": "inactive", "size": 2**25, "frames": [frame("b")]},
                {"state": "active_allocated", "size": 2**24},  # (made before the history)
            ]},
            {"stream": 0, "blocks": [
                {"state": "active_allocated", "size": 2**25, "frames": [frame("c"), frame("d")]},
            ]},
        ]
    }  # fmt: skip
    blocks = live_blocks(snapshot)
    assert [(b.mib, b.stream) for b in blocks] == [(32.0, 0), (1.0, 7)]
    assert blocks[0].frames == ["torch/c.py:3:c", "torch/d.py:3:d"]


def test_the_peak_probe_replays_the_trace_to_the_most_allocated_at_once():
    from benchmarks.graphed_leftover import peak_blocks

    def entry(action, addr, mib, name="f"):
        frames = [{"filename": f"/x/site-packages/ostinato/{name}.py", "line": 1, "name": name}]
        return {"action": action, "addr": addr, "size": mib * 2**20, "stream": 0, "frames": frames}

    trace = [
        entry("free_requested", 99, 64),  # (a block made before the history: skipped)
        entry("alloc", 1, 4, "a"),
        entry("alloc", 2, 8, "b"),
        entry("free_requested", 1, 4),
        entry("free_completed", 1, 4),
        entry("alloc", 3, 2, "c"),  # 10 MiB live: below the 12 before the free
        entry("alloc", 1, 16, "d"),  # (the address reused) 26 MiB: the peak
        entry("free_requested", 2, 8),
    ]
    peak, blocks = peak_blocks({"device_traces": [trace]})
    assert peak == 26.0
    assert [(b.mib, b.frames) for b in blocks] == [
        (16.0, ["ostinato/d.py:1:d"]),
        (8.0, ["ostinato/b.py:1:b"]),
        (2.0, ["ostinato/c.py:1:c"]),
    ]
