"""Checked replays (``ostinato.replay_check``) on the graph test double: a FULL graph that
differs from eager, at capture or in a sampled replay while serving, or whose real rows
move when its padding rows change, is demoted to eager with a warning naming the bucket,
its step returns the eager outputs, and the statistics count it."""

import warnings

import pytest
import torch
from fakes import FakePlatform

from ostinato import BatchDescriptor, Dispatcher, GraphConfig, GraphManager, GraphMode
from ostinato.replay_check import GraphDemotedWarning, ReplayCheck, first_mismatch, tolerance
from ostinato.replay_stats import EagerReason


class Step:
    """A step over a persistent input ``x``; ``scale`` is a Python number (frozen into a
    graph at capture); ``leak`` reduces over every row of the padded batch."""

    def __init__(self, leak=False):
        torch.manual_seed(0)
        self.x = torch.randn(16, 4)  # [max tokens, 4]
        self.w = torch.randn(4, 3)
        self.scale = 1.0
        self.leak = leak

    def __call__(self, d):
        x = self.x[: d.num_tokens]
        if self.leak:
            x = x - x.mean(0)  # padding rows reach the real ones
        return (x @ self.w) * self.scale

    def perturb(self, d, real):
        self.x[real : d.num_tokens] = torch.randn(d.num_tokens - real, 4)

    def set_rows(self, n):
        self.x[:n] = torch.randn(n, 4)


def manager(step, check, sizes=(2, 4, 8), perturb=True):
    return GraphManager(
        step,
        Dispatcher(GraphConfig(mode=GraphMode.FULL, capture_sizes=sizes)),
        check=check,
        perturb_padding=step.perturb if perturb else None,
        platform=FakePlatform(),
        pool=1,
        progress=False,
    )


def run(m, step, n):
    step.set_rows(n)
    dispatch = m.dispatcher.dispatch(n)
    return m.run(dispatch, n), dispatch


def test_a_padding_leak_is_caught_at_capture_and_the_bucket_runs_eagerly_after():
    step = Step(leak=True)
    m = manager(step, ReplayCheck("capture"))
    with pytest.warns(GraphDemotedWarning, match=r"num_tokens=8.*changes its first 4 rows"):
        m.capture()
    assert set(m.demoted) == {m.dispatcher.dispatch(n).descriptor for n in (2, 4, 8)}
    out, dispatch = run(m, step, 5)  # dispatched at 8, run eagerly at 8
    assert not m.ready(dispatch)
    torch.testing.assert_close(out, step(BatchDescriptor(8))[:5])
    stats = m.stats()
    assert stats.eager_steps[EagerReason.DEMOTED] == 1 and len(stats.demoted) == 3


def test_a_frozen_python_number_is_caught_at_capture_without_a_padding_hook():
    step = Step()
    calls = [0]

    def counting(d):
        calls[0] += 1
        return step(d) * calls[0]  # a different number on every call

    counting.perturb = step.perturb
    m = manager(counting, ReplayCheck("capture"), sizes=(4,), perturb=False)
    with pytest.warns(GraphDemotedWarning, match=r"differs from an eager run.*output #0"):
        m.capture()
    assert list(m.demoted) == [BatchDescriptor(4)]


def test_a_well_behaved_step_passes_both_checks_and_replays():
    step = Step()
    m = manager(step, ReplayCheck("capture"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphDemotedWarning)
        m.capture()
    assert not m.demoted
    out, dispatch = run(m, step, 3)
    assert m.ready(dispatch)
    torch.testing.assert_close(out, step(BatchDescriptor(3)))


def test_a_sampled_replay_that_went_stale_is_demoted_and_its_step_returns_eager_outputs():
    step = Step()
    m = manager(step, ReplayCheck("sample", every=3), sizes=(4,))
    m.capture()  # no capture check in "sample"
    step.scale = 2.0  # the graph keeps 1.0
    for _ in range(2):  # unchecked replays: stale
        out, _ = run(m, step, 4)
        assert not torch.allclose(out, step(BatchDescriptor(4)))
    with pytest.warns(GraphDemotedWarning, match=r"num_tokens=4.*sampled step.*up to"):
        out, dispatch = run(m, step, 4)
    torch.testing.assert_close(out, step(BatchDescriptor(4)))  # the eager outputs
    assert not m.ready(dispatch)
    out, _ = run(m, step, 3)  # padded to 4: eager from now on
    torch.testing.assert_close(out, step(BatchDescriptor(3)))
    stats = m.stats()
    assert stats.checked_replays == 1 and stats.demoted == (BatchDescriptor(4),)
    assert stats.eager_steps[EagerReason.DEMOTED] == 1 and stats.replays == 3


def test_sampling_checks_one_replay_in_every_and_keeps_good_buckets():
    step = Step()
    m = manager(step, ReplayCheck("sample", every=4))
    m.capture()
    for i in range(20):
        run(m, step, 1 + i % 8)
    stats = m.stats()
    assert stats.checked_replays == 5 and not stats.demoted and stats.replays == 20


def test_tolerances_and_mismatch_report():
    assert tolerance(torch.int64) == (0.0, 0.0) and tolerance(torch.bool) == (0.0, 0.0)
    assert tolerance(torch.bfloat16)[1] > tolerance(torch.float32)[1] > 0
    a = torch.ones(4, 2)
    b = a.clone()
    b[3, 1] = 5.0
    assert first_mismatch((a,), (b,), 3, exact=True) is None  # only the first 3 rows
    found = first_mismatch((a, a), (a, b), 4, exact=False)
    assert found.output == 1 and found.max_diff == 4.0
    assert "bitwise" in first_mismatch((a,), (b,), 4, exact=True).describe(BatchDescriptor(4), "x")
    nan = a.clone()
    nan[0, 0] = float("nan")
    assert first_mismatch((nan,), (nan.clone(),), 4, exact=False) is not None


def test_bad_options_are_named_and_verify_graphs_is_the_capture_check():
    with pytest.raises(ValueError, match="verify: 'always'"):
        GraphConfig(verify="always")
    with pytest.raises(ValueError, match="verify_every: expected a positive int, got 0"):
        GraphConfig(verify="sample", verify_every=0)
    with pytest.raises(TypeError, match="verify_every"):
        ReplayCheck("sample", every="10")
    assert GraphConfig(verify_graphs=True).replay_check == ReplayCheck("capture")
    # (the sampled check beside it would have been taken for the capture check, or lost)
    with pytest.raises(ValueError, match="verify_graphs=True is verify='capture'; not with"):
        GraphConfig(verify_graphs=True, verify="sample")
    assert GraphConfig(verify="sample", verify_every=7).replay_check.every == 7


def test_background_capture_refuses_the_capture_check_but_samples():
    step = Step()
    with pytest.raises(ValueError, match="verify with a blocking capture"):
        manager(step, ReplayCheck("capture")).capture_in_background()
    m = manager(step, ReplayCheck("sample", every=1))
    m.capture_in_background().wait()
    run(m, step, 4)
    assert m.stats().checked_replays == 1
    m.release()


@pytest.mark.parametrize("apart", [False, True])
def test_a_recaptured_graph_is_checked_at_capture_recorded_in_the_hold_or_beside(apart):
    # A blocking start measures its kernel plans after its graphs and captures sizes
    # again with a turn that holds nothing; where the platform records apart and a
    # warm_step is given, the new graph is warmed up and recorded beside: checked too.
    import contextlib

    step = Step()
    m = manager(step, ReplayCheck("capture"), sizes=(4,))
    m.capture()
    assert not m.demoted
    m.platform.records_apart = apart
    m.warm_step = step
    step.leak = True  # the step now computes otherwise: its padding reaches the real rows
    with pytest.warns(GraphDemotedWarning, match=r"num_tokens=4.*changes its first 2 rows"):
        m.recapture(BatchDescriptor(4), lambda old, new, held: True, contextlib.nullcontext)
    assert list(m.demoted) == [BatchDescriptor(4)]
