"""Micro-batching on the CPU: slicing a step (straddling requests, uneven splits, padding)
and the two threads' turn-taking with fake streams, including a failure in either thread."""

import threading
import time

import pytest

from ostinato.ubatch.handoff import UbatchThreads, current
from ostinato.ubatch.slicing import UbatchSlice, local_query_lens, split_step


def test_a_request_straddling_the_split_is_in_both_micro_batches():
    lens = [3, 6, 2]  # 11 tokens, padded to 12: rows 0-5 | 6-11
    a, b = split_step(lens, 12)
    assert a == UbatchSlice(slice(0, 6), slice(0, 2))
    assert b == UbatchSlice(slice(6, 12), slice(1, 3))
    assert local_query_lens(lens, a) == [3, 3] and local_query_lens(lens, b) == [3, 2]


def test_decode_batches_split_evenly_and_padding_goes_last():
    a, b = split_step([1] * 5, 8)
    assert (a.tokens, a.requests) == (slice(0, 4), slice(0, 4))
    assert (b.tokens, b.requests) == (slice(4, 8), slice(4, 5))
    assert local_query_lens([1] * 5, b) == [1] and b.num_tokens == 4  # 3 padding rows


def test_uneven_splits_and_bad_steps():
    a, b = split_step([7, 1], 8)  # the long request straddles, the short one is all in b
    assert local_query_lens([7, 1], a) == [4] and local_query_lens([7, 1], b) == [3, 1]
    with pytest.raises(ValueError, match="leave micro-batch 1 of 4 rows empty"):
        split_step([2, 1], 8)
    with pytest.raises(ValueError, match="divide into 2"):
        split_step([2, 1], 7)
    with pytest.raises(ValueError, match="must hold the 9 tokens"):
        split_step([5, 4], 8)
    with pytest.raises(ValueError, match=">= 1 token"):
        split_step([0, 4], 8)


class FakeOps:
    """Streams are names; events count; every call is logged with its thread."""

    def __init__(self):
        self.log, self.events, self.lock = [], 0, threading.Lock()

    def _add(self, *entry):
        with self.lock:
            self.log.append((threading.current_thread().name[-1], *entry))

    def use(self, stream):
        self._add("use", stream)

    def record(self, stream):
        with self.lock:
            self.events += 1
            event = self.events
        self._add("record", stream, event)
        return event

    def wait(self, stream, event):
        self._add("wait", stream, event)


def layers(ops, layers=3, fail_at=None):
    def step(i):
        turn = current()
        assert turn is not None and turn.index == i
        for layer in range(layers):
            ops._add("compute", layer)
            if fail_at == (i, layer):
                raise ValueError(f"micro-batch {i} failed at layer {layer}")
            turn.begin_collective()
            ops._add("all_reduce", layer)
            turn.end_collective()
        return f"out{i}"

    return step


def run_once(step, ops, prepare=None):
    """One step on two threads made for it, then ended (the runner keeps its own)."""
    threads = UbatchThreads(2, ops, prepare)
    try:
        return threads.run(step, "compute", "comm")
    finally:
        threads.close()


def test_micro_batches_take_turns_at_every_collective():
    ops = FakeOps()
    out = run_once(layers(ops), ops)
    assert out == ["out0", "out1"]
    work = [
        (t, what, layer)
        for t, what, *rest in ops.log
        if what in ("compute", "all_reduce")
        for layer in rest
    ]
    # One micro-batch's all-reduce is issued, then the other's compute: they overlap.
    assert work[:6] == [
        ("0", "compute", 0),
        ("0", "all_reduce", 0),
        ("1", "compute", 0),
        ("1", "all_reduce", 0),
        ("0", "compute", 1),
        ("0", "all_reduce", 1),
    ]
    # Each collective runs on the comm stream after the compute it follows, and compute
    # resumes only after waiting for it.
    mine = [e for e in ops.log if e[0] == "0"]
    i = mine.index(("0", "all_reduce", 0))
    assert mine[i - 3 : i] == [
        ("0", "record", "compute", 1),
        ("0", "wait", "comm", 1),
        ("0", "use", "comm"),
    ]
    assert ("0", "wait", "compute", 2) in mine[i:]


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_micro_batch_releases_the_other_and_reaches_the_caller(failing):
    ops = FakeOps()
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"micro-batch {failing} failed at layer 1") as info:
        run_once(layers(ops, fail_at=(failing, 1)), ops)
    assert time.perf_counter() - start < 5
    assert "in step" in "".join(__import__("traceback").format_tb(info.value.__traceback__))
    assert not [t for t in threading.enumerate() if t.name.startswith("ostinato-ubatch")]


def test_a_failure_before_the_turns_start_does_not_hang():
    ops = FakeOps()
    calls = []

    def prepare():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("no CUDA state")

    with pytest.raises(RuntimeError, match="no CUDA state"):
        run_once(layers(ops), ops, prepare=prepare)


def test_threads_started_once_serve_every_step_and_outlive_a_failure():
    # The runner keeps its micro-batch threads: their set-up (CUDA state) runs once, long
    # before any graph capture, and a failed step leaves them serving the next one.
    from contextlib import contextmanager

    ops, prepared, entered = FakeOps(), [], []

    @contextmanager
    def capture():
        entered.append(sorted(prepared))  # every thread was ready before this began
        yield

    threads = UbatchThreads(
        2, ops, prepare=lambda: prepared.append(threading.current_thread().name)
    )
    try:
        assert threads.run(layers(ops), "compute", "comm", start=capture) == ["out0", "out1"]
        with pytest.raises(ValueError, match="micro-batch 1 failed at layer 2"):
            threads.run(layers(ops, fail_at=(1, 2)), "compute", "comm")
        assert threads.run(layers(ops), "compute", "comm") == ["out0", "out1"]
        assert sorted(prepared) == ["ostinato-ubatch0", "ostinato-ubatch1"]
        assert entered == [["ostinato-ubatch0", "ostinato-ubatch1"]]
        assert current() is None  # the caller's thread never holds a turn
    finally:
        threads.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("ostinato-ubatch")]
    with pytest.raises(RuntimeError, match="closed"):
        threads.run(layers(ops), "compute", "comm")


def test_the_policy_refuses_bad_settings_by_name():
    from ostinato.ubatch.policy import MicroBatching

    for kw, name in (
        ({"decode_threshold": 1}, "decode_threshold"),
        ({"prefill_threshold": True}, "prefill_threshold"),
        ({"measure": "yes"}, "measure"),
        ({"min_speedup": 0}, "min_speedup"),
        ({"min_speedup": True}, "min_speedup"),
        ({"measure_repeats": 0}, "measure_repeats"),
    ):
        with pytest.raises(ValueError, match=f"micro_batching.{name}"):
            MicroBatching(**kw)
    assert MicroBatching().measure  # captured sizes are split only where measured faster
