import pytest
import torch
from fakes import FakePlatform

from ostinato import (
    BatchDescriptor,
    CaptureNotAllowedError,
    GraphCaptureError,
    GraphMode,
    GraphOptions,
    GraphWrapper,
    InputAddressChangedError,
    capture_phase,
    forward_context,
)


class Scale:
    """out[:n] = x * w into a persistent output buffer."""

    def __init__(self, platform):
        self.platform = platform
        self.calls = 0
        self.out = torch.zeros(8)
        self.w = torch.tensor(2.0)
        self.label = "scale"

    def __call__(self, x):
        self.calls += 1
        n = x.shape[0]
        return torch.mul(x, self.w, out=self.out[:n])


def make(options=None, mode=GraphMode.FULL):
    p = FakePlatform()
    fn = Scale(p)
    return p, fn, GraphWrapper(fn, mode, options=options, platform=p, pool="pool")


def test_captures_once_then_replays_on_new_data():
    p, fn, w = make()
    x = torch.arange(4.0)
    d = BatchDescriptor(4)
    with capture_phase(), forward_context(GraphMode.FULL, d):
        out = w(x)
    assert fn.calls == 1 and len(p.graphs) == 1 and torch.equal(out, x * 2)
    x.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))
    for _ in range(3):
        with forward_context(GraphMode.FULL, d):
            out = w(x)
    assert fn.calls == 1, "replay must not call the runnable"
    assert p.graphs[0].replays == 3
    assert torch.equal(out, torch.tensor([10.0, 12.0, 14.0, 16.0]))


def test_one_graph_per_descriptor():
    p, fn, w = make(GraphOptions(lazy_capture=True))
    for n in (1, 2, 4, 2, 1):
        with forward_context(GraphMode.FULL, BatchDescriptor(n)):
            w(torch.ones(n))
    assert len(w.entries) == 3 and fn.calls == 3


@pytest.mark.parametrize("ctx_mode", [None, GraphMode.NONE, GraphMode.PIECEWISE])
def test_runs_eagerly_when_mode_does_not_match(ctx_mode):
    p, fn, w = make()
    x = torch.ones(2)
    if ctx_mode is None:
        w(x)
    else:
        with forward_context(ctx_mode, BatchDescriptor(2)):
            w(x)
    assert fn.calls == 1 and p.graphs == [] and w.entries == {}


def test_capture_outside_capture_phase_is_an_error():
    p, fn, w = make()
    with (
        forward_context(GraphMode.FULL, BatchDescriptor(2)),
        pytest.raises(CaptureNotAllowedError, match="lazy_capture=True"),
    ):
        w(torch.ones(2))
    assert w.entries == {} and fn.calls == 0


def test_lazy_capture_allows_first_use_capture():
    p, fn, w = make(GraphOptions(lazy_capture=True))
    with forward_context(GraphMode.FULL, BatchDescriptor(2)):
        w(torch.ones(2))
    assert len(w.entries) == 1


def test_check_addresses_names_the_moved_argument():
    p, fn, w = make(GraphOptions(check_addresses=True, lazy_capture=True))
    x = torch.ones(4)
    d = BatchDescriptor(4)
    with forward_context(GraphMode.FULL, d):
        w(x)
        w(x)  # same address: fine
        with pytest.raises(InputAddressChangedError, match=r"input argument #0 was at 0x"):
            w(torch.ones(4))


def test_debug_names_moved_keyword_argument():
    p = FakePlatform()
    w = GraphWrapper(
        lambda a, *, b: a + b,
        GraphMode.FULL,
        platform=p,
        pool=1,
        options=GraphOptions(check_addresses=True, lazy_capture=True),
    )
    a, b = torch.ones(2), torch.ones(2)
    with forward_context(GraphMode.FULL, BatchDescriptor(2)):
        w(a, b=b)
        with pytest.raises(InputAddressChangedError, match="argument 'b'"):
            w(a, b=torch.ones(2))


def test_failed_capture_names_op_and_leaves_no_entry():
    p = FakePlatform(fail_capture=RuntimeError("operation not permitted when stream is capturing"))

    def model(x):
        if p.sync_errors_active:
            raise RuntimeError("called a synchronizing CUDA operation")
        return x + 1

    w = GraphWrapper(
        model, GraphMode.FULL, platform=p, pool=1, options=GraphOptions(lazy_capture=True)
    )
    with forward_context(GraphMode.FULL, BatchDescriptor(2)), pytest.raises(GraphCaptureError) as e:
        w(torch.ones(2))
    msg = str(e.value)
    assert "operation not permitted" in msg
    assert "test_graph_wrapper.py" in msg and "in model" in msg
    assert "synchronizing" in msg and ".item()" in msg
    assert w.entries == {}


def test_failed_capture_without_sync_says_so():
    p = FakePlatform(fail_capture=RuntimeError("boom"))
    w = GraphWrapper(
        lambda x: x, GraphMode.FULL, platform=p, pool=1, options=GraphOptions(lazy_capture=True)
    )
    with (
        forward_context(GraphMode.FULL, BatchDescriptor(2)),
        pytest.raises(GraphCaptureError, match="not a host sync"),
    ):
        w(torch.ones(2))


def test_missing_descriptor_is_a_clear_error():
    p, fn, w = make(GraphOptions(lazy_capture=True))
    with (
        forward_context(GraphMode.FULL, None),
        pytest.raises(ValueError, match="no batch descriptor"),
    ):
        w(torch.ones(2))


def test_entry_output_is_non_owning_view_of_capture_output():
    p, fn, w = make(GraphOptions(lazy_capture=True))
    with forward_context(GraphMode.FULL, BatchDescriptor(4)):
        out = w(torch.ones(4))
    entry = w.entries[BatchDescriptor(4)]
    assert entry.output.data_ptr() == out.data_ptr()
    assert entry.output.untyped_storage() is not out.untyped_storage()


def test_weak_ref_output_option_returns_view_on_capture():
    p, fn, w = make(GraphOptions(lazy_capture=True, weak_ref_output=True))
    with forward_context(GraphMode.FULL, BatchDescriptor(4)):
        out = w(torch.ones(4))
    assert out.data_ptr() == fn.out.data_ptr()


def test_reset_drops_graphs():
    p, fn, w = make(GraphOptions(lazy_capture=True))
    with forward_context(GraphMode.FULL, BatchDescriptor(2)):
        w(torch.ones(2))
    w.reset()
    assert w.entries == {} and p.graphs[0].was_reset


def test_rejects_non_graph_modes():
    with pytest.raises(ValueError, match="FULL or PIECEWISE"):
        GraphWrapper(lambda: None, GraphMode.NONE, platform=FakePlatform(), pool=1)
