"""``torch.compile(model, backend="ostinato")`` through the test double for graphs: the
backend found through its entry point, the first batch size graphed at that size alone,
later ones replayed over the ladder and equal to eager, the module's parameters and buffers kept as
they are, and bad options named as the user wrote them."""

import pytest
import torch
from fakes import FakePlatform

import ostinato
from ostinato.backend import ostinato_backend


def model():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(8)
    bn.running_mean.normal_()  # (a buffer: kept, not padded)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), bn, torch.nn.GELU(), torch.nn.Linear(8, 2))


def test_the_backend_is_found_through_its_entry_point():
    assert torch._dynamo.lookup_backend("ostinato") is ostinato_backend


def test_calls_replay_graphs_and_equal_eager():
    torch._dynamo.reset()
    m = model().eval()
    options = {"platform": FakePlatform(), "max_batch_size": 16}
    fast = torch.compile(m, backend="ostinato", options=options)
    with torch.inference_mode():
        for b in (3, 5, 7, 9, 12, 16, 20, 2):
            x = torch.randn(b, 4)
            torch.testing.assert_close(fast(x), m(x))
    mine = [g for g in ostinato.compiled_graphs() if g.options.platform is options["platform"]]
    # Two compiles: 3 traced as it is (graphed at 3 alone), then the dynamic batch over the
    # ladder. 20 is above the largest bucket; the seven others replayed.
    ladders = sorted(str(g.options.config.capture_sizes) for g in mine)
    assert ladders == sorted(["(3,)", str(tuple(range(1, 17)))])  # and max_batch_size's
    assert sum(b.replays for g in mine for s in g.stats().signatures for b in s.stats.buckets) == 7


def test_a_second_dynamic_dimension_is_read_from_the_padded_tensors():
    # The sequence length becomes a size of the graph too: with seq_buckets it is padded,
    # and the graph runs at the bucket's length, read back from the padded tensor.
    torch._dynamo.reset()
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU()).eval()
    options = {"platform": FakePlatform(), "max_batch_size": 8, "seq_buckets": (8, 16)}
    fast = torch.compile(m, backend="ostinato", options=options, dynamic=True)
    with torch.inference_mode():
        for b, t in ((2, 5), (3, 7), (4, 12), (1, 16)):
            x = torch.randn(b, t, 4)
            torch.testing.assert_close(fast(x), m(x))
    # (Dynamo compiles a batch of 1 apart, as it specializes sizes 0 and 1: graphed alone)
    mine = [g for g in ostinato.compiled_graphs() if g.options.platform is options["platform"]]
    signatures = [s for g in mine for s in g.stats().signatures]
    assert sum(b.replays for s in signatures for b in s.stats.buckets) == 4


def test_bad_options_are_named_as_written():
    torch._dynamo.reset()
    fast = torch.compile(model().eval(), backend="ostinato", options={"max_batch_size": "many"})
    # Refused at the first compile, traced for one batch (which drops the ladder's
    # options), not only at the dynamic one that uses them.
    with torch.inference_mode(), pytest.raises(Exception, match="max_batch_size: expected"):
        fast(torch.randn(5, 4))
    with pytest.raises(ValueError, match="takes no mode"):
        ostinato_backend(torch.fx.symbolic_trace(torch.nn.ReLU()), [], mode="reduce-overhead")
