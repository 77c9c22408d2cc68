"""The step timeline's reading of a profiler trace (``benchmarks.step_gaps.analyse``) on a
made-up trace whose gaps and steps are known."""

from benchmarks.step_gaps import STEP_START, analyse


def _trace(steps: int) -> list[dict]:
    """``steps`` steps of: embed (10 us), a copy 5 us after it (2 us, launched late: its
    launch 1 us after the embed ended), a kernel 2 us after the copy (20 us)."""
    events, t, corr = [], 0.0, 0
    for _ in range(steps):
        for name, gap, dur, late in (
            (STEP_START, 0.0, 10.0, False),
            ("copy", 5.0, 2.0, True),
            ("kernel", 2.0, 20.0, False),
        ):
            start = t + gap
            corr += 1
            cat = "gpu_memcpy" if name == "copy" else "kernel"
            events.append(
                {
                    "ph": "X",
                    "cat": cat,
                    "name": name,
                    "ts": start,
                    "dur": dur,
                    "args": {"correlation": corr},
                }
            )
            launch_ts = t + 1.0 if late else start - 50.0
            events.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": f"launch {name}",
                    "ts": launch_ts,
                    "dur": 1.0,
                    "args": {"correlation": corr},
                }
            )
            t = start + dur
    return events


def test_gaps_are_counted_per_step_by_their_launch_and_lateness():
    out = analyse(_trace(12), "x", 1.0)
    # 12 steps found, the first and last cut, the first quarter of the rest dropped
    assert out.steps == 10 - 10 // 4
    assert out.gaps_us_per_step == 5.0  # (the 2 us gap is under the 3 us threshold)
    assert out.host_late_us_per_step == 5.0
    assert out.gaps_by_launch == {"launch copy (host late)": 5.0}
    assert out.kernels_us_per_step == {"kernel": 20.0, STEP_START: 10.0, "copy": 2.0}
    assert [op.name for op in out.median_step] == [STEP_START, "copy", "kernel"]
    assert [op.gap_us for op in out.median_step] == [0.0, 5.0, 2.0]
    assert out.busy_share == round(32 / 39, 4)
