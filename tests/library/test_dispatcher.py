import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ostinato import BatchDescriptor, Dispatcher, GraphConfig
from ostinato import GraphMode as M


def brute_pad(sizes, n):
    return min(s for s in sizes if s >= n)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.sets(st.integers(1, 300), min_size=1, max_size=20),
    n=st.integers(0, 400),
    uniform=st.booleans(),
)
def test_full_mode_pads_to_smallest_size_that_fits(sizes, n, uniform):
    d = Dispatcher(GraphConfig(mode=M.FULL, capture_sizes=tuple(sizes)))
    r = d.dispatch(n, uniform_decode=uniform)
    if n == 0:
        assert r.mode is M.NONE and r.padded_tokens == 0
    elif n > max(sizes):
        assert r.mode is M.NONE
        assert r.descriptor == BatchDescriptor(n, None, uniform, False)
    else:
        assert r.mode is M.FULL
        # FULL without a separate routine: one graph per size serves decode and mixed.
        assert r.descriptor == BatchDescriptor(brute_pad(sizes, n), None, False, False)


def test_dispatch_is_table_lookup_returning_same_object():
    d = Dispatcher(GraphConfig(mode=M.FULL))
    assert d.dispatch(17) is d.dispatch(17)


@pytest.mark.parametrize("n, expected_tokens", [(1, 1), (3, 4), (9, 16), (257, 272), (512, 512)])
def test_full_and_piecewise_decode_is_full_mixed_is_piecewise(n, expected_tokens):
    d = Dispatcher(GraphConfig(mode=M.FULL_AND_PIECEWISE))
    dec = d.dispatch(n, uniform_decode=True)
    assert dec.mode is M.FULL
    assert dec.descriptor == BatchDescriptor(expected_tokens, expected_tokens, True, False)
    mix = d.dispatch(n, uniform_decode=False)
    assert mix.mode is M.PIECEWISE
    assert mix.descriptor == BatchDescriptor(expected_tokens, None, False, False)


def test_full_decode_only_runs_mixed_batches_eagerly_unpadded():
    d = Dispatcher(GraphConfig(mode=M.FULL_DECODE_ONLY))
    assert d.dispatch(5, uniform_decode=True).mode is M.FULL
    mix = d.dispatch(5, uniform_decode=False)
    assert mix.mode is M.NONE and mix.padded_tokens == 5
    assert d.keys(M.PIECEWISE) == []


def test_uniform_decode_graphs_bounded_by_max_num_reqs():
    d = Dispatcher(GraphConfig(mode=M.FULL_DECODE_ONLY), max_num_reqs=16)
    assert d.dispatch(16, uniform_decode=True).mode is M.FULL
    assert d.dispatch(17, uniform_decode=True).mode is M.NONE
    assert max(k.num_tokens for k in d.keys(M.FULL)) == 16


@pytest.mark.parametrize("mode", [M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE])
@pytest.mark.parametrize("q", [2, 3, 4, 5])
def test_spec_decode_graphs_are_query_len_times_the_request_ladder(mode, q):
    # Verify steps carry q = 1 + k tokens per request: every uniform batch of r requests
    # replays a FULL graph of q x (the ladder's request count >= r) tokens.
    config = GraphConfig(mode=mode)
    d = Dispatcher(config, uniform_decode_query_len=q, max_num_reqs=32)
    ladder = [s for s in config.sizes if s <= 32]
    for r in range(1, 33):
        got = d.dispatch(q * r, uniform_decode=True)
        want_reqs = min(s for s in ladder if s >= r)
        assert got.mode is M.FULL, (q, r, got)
        assert got.descriptor == BatchDescriptor(q * want_reqs, want_reqs, True, False)
    assert sorted(k.num_tokens for k in d.keys(M.FULL)) == [q * s for s in ladder]
    mixed = d.dispatch(q * 3, uniform_decode=False)  # a prefill among them: the ladder
    assert mixed.mode is config.mode.mixed_mode()
    if mixed.mode is not M.NONE:
        assert mixed.padded_tokens == min(s for s in config.sizes if s >= q * 3)


def test_none_mode_never_pads():
    d = Dispatcher(GraphConfig(mode=M.NONE))
    for n in (1, 3, 100, 600):
        r = d.dispatch(n)
        assert r.mode is M.NONE and r.padded_tokens == n
    assert d.keys(M.FULL) == [] and d.keys(M.PIECEWISE) == []


def test_resolved_mode_overrides_config():
    d = Dispatcher(GraphConfig(mode=M.FULL), M.PIECEWISE)
    assert d.dispatch(3).mode is M.PIECEWISE


def test_lora_specialisation():
    cfg = GraphConfig(mode=M.FULL, capture_sizes=(1, 8), specialize_lora=True)
    d = Dispatcher(cfg, lora_enabled=True)
    assert d.dispatch(3, has_lora=True).descriptor.has_lora
    assert not d.dispatch(3, has_lora=False).descriptor.has_lora
    assert len(d.keys(M.FULL)) == 4
    # Without specialisation every graph is captured with LoRA active and serves both.
    d = Dispatcher(GraphConfig(mode=M.FULL, capture_sizes=(1, 8)), lora_enabled=True)
    assert d.dispatch(3, has_lora=False).descriptor.has_lora
    assert len(d.keys(M.FULL)) == 2


def test_bad_input_errors():
    d = Dispatcher(GraphConfig(mode=M.FULL))
    with pytest.raises(ValueError, match="lora_enabled=False"):
        d.dispatch(3, has_lora=True)
    with pytest.raises(ValueError, match="num_tokens: must be >= 0"):
        d.dispatch(-1)
    with pytest.raises(ValueError, match="keys exist only for FULL and PIECEWISE"):
        d.keys(M.NONE)
    with pytest.raises(ValueError, match="uniform_decode_query_len"):
        Dispatcher(GraphConfig(), uniform_decode_query_len=0)


def test_keys_cover_every_dispatch_and_are_largest_first():
    d = Dispatcher(GraphConfig(mode=M.FULL_AND_PIECEWISE, max_capture_size=64))
    full, pw = set(d.keys(M.FULL)), set(d.keys(M.PIECEWISE))
    for n in range(1, 65):
        for u in (False, True):
            r = d.dispatch(n, uniform_decode=u)
            assert r.descriptor in (full if r.mode is M.FULL else pw)
    sizes = [k.num_tokens for k in d.keys(M.FULL)]
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize(
    "args, message",
    [
        ((2.5,), r"num_tokens: expected an int .* got 2.5 \(float\)"),
        (("3",), r"num_tokens: expected an int .* got '3' \(str\)"),
        ((3, "yes"), "uniform_decode: expected True or False, got 'yes'"),
    ],
)
def test_arguments_of_the_wrong_type_are_named(args, message):
    d = Dispatcher(GraphConfig(max_capture_size=16), M.FULL)
    with pytest.raises(TypeError, match=message):
        d.dispatch(*args)
