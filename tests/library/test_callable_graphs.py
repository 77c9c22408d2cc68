"""``ostinato.graphed``: any callable as graphs in one call. On the CPU with the graph
test double (``FakePlatform``: capture records the ops, replay re-runs them on whatever
the persistent buffers hold) every argument form, random size streams against eager,
the padding check, the statistics against a brute-force count, and the named errors;
on the plain CPU platform the eager fallback that says why once."""

import contextlib
import inspect
import random
import threading
import warnings

import pytest
import torch
from fakes import FakePlatform, capture_threads
from torch.utils._python_dispatch import TorchDispatchMode

import ostinato
from ostinato import GraphMode, callable_graphs
from ostinato.callable_graphs import PaddingChangesRealRowsError, SignatureLimitError
from ostinato.platform.cpu import CpuPlatform


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def eager(fn, *args, **kwargs):
    with torch.inference_mode():
        return fn(*args, **kwargs)


def test_a_random_size_stream_equals_eager_and_is_counted_per_bucket():
    model, platform = mlp().eval(), FakePlatform()
    ladder = (1, 2, 4, 8, 16)
    fast = ostinato.graphed(model, capture_sizes=ladder, platform=platform, capture="first_use")
    rng = random.Random(1)
    sizes = [rng.randint(1, 24) for _ in range(40)]
    for n in sizes:
        x = torch.randn(n, 8)
        torch.testing.assert_close(fast(x), eager(model, x), atol=1e-6, rtol=1e-5)
    stats = fast.stats()
    (sig,) = stats.signatures
    dispatcher = ostinato.Dispatcher(
        ostinato.GraphConfig(capture_sizes=ladder), ostinato.GraphMode.FULL
    )
    graphed_sizes = [n for n in sizes if n <= 16]
    assert sig.stats.replays == len(graphed_sizes) == sum(g.replays for g in platform.graphs)
    assert stats.eager == len(sizes) - len(graphed_sizes)
    padded = sum(dispatcher.dispatch(n).padded_tokens for n in graphed_sizes)
    assert sum(b.padded_rows for b in sig.stats.buckets) == padded
    assert sum(b.real_rows for b in sig.stats.buckets) == sum(graphed_sizes)
    assert "calls from graphs" in stats.summary()


class Several(torch.nn.Module):
    """Two tensor inputs (one a keyword), a constant, and a dict of outputs."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, pair, *, scale=1.0, mask=None):
        a, b = pair
        h = self.proj(x) * scale + a - b
        if mask is not None:
            h = h * mask[:, :1]
        return {"h": h, "parts": (h.sum(-1), a * 2)}


def test_several_inputs_keywords_constants_and_dict_outputs():
    model, platform = Several().eval(), FakePlatform()
    fast = ostinato.graphed(model, max_batch_size=8, platform=platform, capture="first_use")
    for n, scale in [(3, 1.0), (5, 2.0), (3, 1.0), (8, 2.0)]:
        x, a, b, mask = (torch.randn(n, 8) for _ in range(4))
        got = fast(x, (a, b), scale=scale, mask=mask)
        want = eager(model, x, (a, b), scale=scale, mask=mask)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert len(fast.stats().signatures) == 2  # one per value of the constant `scale`


def test_outputs_are_copies_where_the_platform_cannot_revoke_an_alias():
    model = mlp().eval()
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    fast = ostinato.graphed(model, max_batch_size=8, platform=FakePlatform(), capture="first_use")
    first = fast(x)
    fast(y)
    torch.testing.assert_close(first, eager(model, x))


def test_outputs_are_lent_until_the_next_call_which_revokes_them_after_reading_its_args():
    torch.manual_seed(0)
    square = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval()
    platform = FakePlatform(lends=True)
    fast = ostinato.graphed(square, max_batch_size=8, platform=platform, capture="first_use")
    x = torch.randn(3, 8)
    first = fast(x)
    assert platform.lent and first.data_ptr() == platform.lent[-1].data_ptr()
    assert platform.revoked == []
    torch.testing.assert_close(first, eager(square, x))
    want = eager(square, first.clone())
    second = fast(first)  # a lent output as the next call's argument: read before revoked
    torch.testing.assert_close(second, want)
    assert [i for i, _ in platform.revoked] == [0]  # the first call's, at the second call
    message = platform.revoked[0][1]
    assert "Sequential" in message and "copy_outputs=True" in message and "clone()" in message
    fast.release()
    assert [i for i, _ in platform.revoked] == [0, 1]  # release() revokes the last one


def test_copied_outputs_and_an_eager_calls_own_outputs_are_not_lent():
    model = mlp().eval()
    platform = FakePlatform(lends=True)
    fast = ostinato.graphed(
        model, max_batch_size=4, platform=platform, capture="first_use", copy_outputs=True
    )
    first = fast(torch.randn(3, 8))
    assert platform.lent == [] and first.data_ptr() not in {t.data_ptr() for t in platform.lent}
    lending = ostinato.graphed(model, max_batch_size=4, platform=platform, capture="first_use")
    x = torch.randn(9, 8)  # above the largest bucket: eager, on the caller's tensors
    torch.testing.assert_close(lending(x), eager(model, x))
    assert platform.lent == []


def test_capture_at_construction_needs_an_example_and_captures_at_once():
    platform = FakePlatform()
    example = ((torch.randn(2, 8),), {})
    ostinato.graphed(
        mlp().eval(), max_batch_size=4, platform=platform, capture="construction", example=example
    )
    assert len(platform.graphs) == 4  # sizes 4, 3, 2, 1
    with pytest.raises(ValueError, match="example"):
        ostinato.graphed(mlp(), capture="construction")


def test_a_second_dynamic_dimension_by_buckets():
    torch.manual_seed(0)
    proj = torch.nn.Linear(6, 6).eval()

    def encoder(ids, mask):  # masked mean over the sequence, then per-position output
        h = proj(ids)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return h + pooled[:, None, :], pooled

    fast = ostinato.graphed(
        encoder, max_batch_size=4, seq_buckets=(8, 16), platform=FakePlatform(), capture="first_use"
    )
    rng = random.Random(2)
    lengths = []
    for _ in range(12):
        n, length = rng.randint(1, 4), rng.randint(1, 20)
        lengths.append(length)
        ids, mask = torch.randn(n, length, 6), torch.ones(n, length)
        got, want = fast(ids, mask), eager(encoder, ids, mask)
        assert got[0].shape == (n, length, 6)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    stats = fast.stats()
    buckets = {8 if length <= 8 else 16 for length in lengths if length <= 16}
    assert sorted(s.key.split(" ")[-1] for s in stats.signatures) == sorted(
        f"seq<={b}" for b in buckets
    )
    assert stats.eager_too_long == sum(length > 16 for length in lengths) > 0
    assert stats.replays == sum(length <= 16 for length in lengths)


def test_padding_that_changes_real_rows_is_named():
    bn = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))  # training mode
    with pytest.raises(PaddingChangesRealRowsError, match=r"\.eval\(\)"):
        ostinato.graphed(bn, max_batch_size=8, platform=FakePlatform(), capture="first_use")(
            torch.randn(3, 8)
        )

    def centre(x):
        return x - x.mean(0)  # a reduction over the batch

    with pytest.raises(PaddingChangesRealRowsError, match="output #0"):
        ostinato.graphed(centre, max_batch_size=8, platform=FakePlatform(), capture="first_use")(
            torch.randn(3, 8)
        )
    unchecked = ostinato.graphed(
        centre, max_batch_size=8, platform=FakePlatform(), capture="first_use", check_padding=False
    )
    unchecked(torch.randn(3, 8))  # the caller said the mixing is intended


def _allclose_in_float64(a, b):
    a, b = a.double(), b.double()
    atol = 1e-3 * max(a.abs().max().item(), 1e-6)
    if torch.allclose(a, b, rtol=1e-3, atol=atol, equal_nan=True):
        return None
    return (a - b).abs().max().item()


@pytest.mark.parametrize("chunk", [1, 7, 1 << 22])
def test_the_padding_comparison_by_chunks_equals_one_in_float64_whole(monkeypatch, chunk):
    monkeypatch.setattr(callable_graphs, "_CHUNK_ELEMENTS", chunk)
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        rows, cols = 1 + trial % 9, 1 + trial % 5
        a = torch.randn(rows, cols, generator=gen) * 10 ** (trial % 4)
        b = a.clone()
        if trial % 3:  # a change near or past the tolerance, in a random row
            r, c = (
                torch.randint(rows, (1,), generator=gen),
                torch.randint(cols, (1,), generator=gen),
            )
            b[r, c] += (
                (1e-3 if trial % 3 == 1 else 1e-1) * a.abs().max() * torch.rand(1, generator=gen)
            )
        for dtype in (torch.float32, torch.bfloat16):
            x, y = a.to(dtype), b.to(dtype)
            got, want = callable_graphs.real_rows_differ(x, y), _allclose_in_float64(x, y)
            assert (got is None) == (want is None), (trial, dtype, got, want)
            if got is not None:
                assert got == pytest.approx(want, rel=1e-6)


def test_the_padding_check_holds_no_float_copy_of_a_whole_output(monkeypatch):
    """Logits of a language model at 33 rows are large: the check's copies stay a chunk."""
    monkeypatch.setattr(callable_graphs, "_CHUNK_ELEMENTS", 64)
    largest = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype in (torch.float32, torch.float64):
                largest.append(out.numel())
            return out

    x = torch.randn(33, 1000).to(torch.bfloat16)
    with Sizes():
        assert callable_graphs.real_rows_differ(x[:32], x[:32].clone()) is None
    assert max(largest) <= 1000  # one row at a time (a row is over the chunk)
    bad = torch.tensor([[True, False], [False, False]])
    assert callable_graphs.real_rows_differ(bad, ~bad) == 1.0  # booleans compare too


def test_on_the_cpu_every_call_runs_eagerly_and_says_why_once():
    model = mlp().eval()
    fast = ostinato.graphed(model, max_batch_size=8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for n in (3, 3, 20):
            x = torch.randn(n, 8)
            torch.testing.assert_close(fast(x), eager(model, x))
    assert [str(w.message) for w in seen] == [
        "ostinato.graphed: every call runs eagerly: the cpu platform has no graphs"
    ]


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda f: f(torch.randn(3, 8), [1, object()]), TypeError, r"args\[1\]\[1\]: a object"),
        (lambda f: f(torch.randn(3, 8), torch.randn(4, 8)), ValueError, r"args\[1\]: its batch"),
        (
            lambda f: f(torch.randn(3, 8), torch.tensor(1.0)),
            ValueError,
            r"args\[1\]: a tensor of shape \(\)",
        ),
        (lambda f: f(1, 2), ValueError, "no tensor argument"),
    ],
)
def test_arguments_that_cannot_be_graphed_are_named(call, error, words):
    fast = ostinato.graphed(
        lambda x, *rest: x, max_batch_size=8, platform=FakePlatform(), capture="first_use"
    )
    with pytest.raises(error, match=words):
        call(fast)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(capture="soon"), ValueError, "capture: one of"),
        (dict(seq_buckets="128"), TypeError, "seq_buckets"),
        (dict(seq_buckets=[64, 8, 64]), ValueError, r"^seq_buckets: duplicate buckets \[64\]"),
        (dict(capture_sizes=[]), ValueError, "^capture_sizes: empty; .* mode 'none'"),
        (dict(max_signatures=0), ValueError, "max_signatures"),
        (dict(max_batch_size="128"), TypeError, "^max_batch_size: expected a positive int"),
        (dict(max_batch_size=0), ValueError, "^max_batch_size: expected a positive int, got 0"),
        (dict(max_batch_size=True), TypeError, "^max_batch_size: expected a positive int"),
        (dict(max_batch_size=10**9), ValueError, "^max_batch_size: 1000000000 makes a ladder"),
        (dict(capture_sizes="1,2"), TypeError, "^capture_sizes: expected a sequence"),
        (dict(max_batch_size=4, capture_sizes=[8]), ValueError, "give one .* not both"),
        (dict(splitting_ops="lib::op"), TypeError, "^splitting_ops: expected a sequence"),
        (dict(copy_outputs="yes"), TypeError, "^copy_outputs: expected True or False"),
        (dict(example=((), {})), ValueError, "only used with capture='construction'"),
        (dict(mode="full_and_piecewise"), ValueError, "pass full_when="),
        (dict(mode="full_decode_only"), ValueError, "pass full_when="),
        (dict(full_when=lambda x: True), ValueError, "full_when: only used with"),
        (dict(mode="full_decode_only", full_when=3), TypeError, "full_when: expected a function"),
        (dict(mode="sometimes"), ValueError, "unknown graph mode"),
        (dict(compiler="tvm"), ValueError, "compiler: 'auto', 'inductor', 'eager' or None"),
        (dict(seq_dim=2), ValueError, "^seq_dim=2: only used with seq_buckets"),
        (dict(seq_buckets=[8], seq_dim=0), ValueError, r"^seq_dim: .* \(dim 0 is the batch\)"),
        (dict(seq_buckets=[8], seq_dim=-1), ValueError, "^seq_dim: the sequence's dimension"),
    ],
)
def test_bad_options_are_named(kwargs, error, words):
    with pytest.raises(error, match=words):
        ostinato.graphed(mlp(), **kwargs)
    with pytest.raises(TypeError, match="module or function"):
        ostinato.graphed(42)


def test_every_bad_argument_is_named_as_written():
    # Each of graphed's arguments given a value it cannot take: the error names that
    # argument, never an internal field, and nothing is accepted to be ignored.
    for name in inspect.signature(ostinato.graphed).parameters:
        if name == "fn":
            continue
        with pytest.raises((TypeError, ValueError)) as exc:
            ostinato.graphed(mlp(), **{name: object()})
        assert str(exc.value).startswith(f"{name}"), (name, str(exc.value))


def test_too_many_signatures_are_refused_with_the_fix():
    fast = ostinato.graphed(
        lambda x: x * 2,
        max_batch_size=4,
        platform=FakePlatform(),
        capture="first_use",
        max_signatures=2,
    )
    fast(torch.randn(2, 3))
    fast(torch.randn(2, 5))
    with pytest.raises(SignatureLimitError, match="seq_buckets"):
        fast(torch.randn(2, 7))


@torch.library.custom_op("ostinato_graphed_test::mix", mutates_args=("out",))
def mix(x: torch.Tensor, out: torch.Tensor) -> None:  # runs eagerly between pieces
    torch.softmax(x, -1, out=out)


class Mix(torch.nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)  # made by the piece before: a fixed address
        mix(x, out)
        return out


def test_piecewise_graphs_split_at_the_ops_named():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), Mix(), torch.nn.Linear(16, 8)).eval()
    platform = FakePlatform()
    fast = ostinato.graphed(
        model,
        max_batch_size=8,
        mode="piecewise",
        splitting_ops=("ostinato_graphed_test::mix",),
        compiler="eager",
        platform=platform,
    )
    for n in (3, 8, 1, 5, 12):
        x = torch.randn(n, 8)
        torch.testing.assert_close(fast(x), eager(model, x), atol=1e-6, rtol=1e-5)
    (sig,) = fast.stats().signatures
    assert sig.stats.replays == 4 and sig.stats.eager == 1  # 12 is above the largest
    assert platform.graphs  # the pieces' graphs


@pytest.mark.parametrize("mode", ["full_and_piecewise", "full_decode_only"])
def test_calls_full_when_accepts_replay_full_graphs_and_the_others_do_not(mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), Mix(), torch.nn.Linear(16, 8)).eval()
    platform = FakePlatform()
    fast = ostinato.graphed(
        model,
        max_batch_size=8,
        mode=mode,
        splitting_ops=("ostinato_graphed_test::mix",),
        full_when=lambda x: x.shape[0] <= 4,  # say small calls are the graph-safe ones
        compiler="eager",
        platform=platform,
    )
    sizes = [3, 8, 1, 5, 4, 7, 2]
    for n in sizes:
        x = torch.randn(n, 8)
        torch.testing.assert_close(fast(x), eager(model, x), atol=1e-6, rtol=1e-5)
    (sig,) = fast.stats().signatures
    by_mode = {m: sum(b.replays for b in sig.stats.buckets if b.mode is m) for m in GraphMode}
    small = sum(n <= 4 for n in sizes)
    assert by_mode[GraphMode.FULL] == small
    if mode == "full_and_piecewise":
        assert by_mode[GraphMode.PIECEWISE] == len(sizes) - small
    else:
        assert by_mode[GraphMode.PIECEWISE] == 0 and sig.stats.eager == len(sizes) - small
    full = [b.descriptor for b in sig.stats.buckets if b.mode is GraphMode.FULL and b.replays]
    assert all(d.uniform_decode and d.num_tokens <= 4 for d in full)


def test_only_the_static_outputs_are_lent_a_pieces_outputs_are_copied():
    # A piece's outputs sit where its next replay writes, owned by no arena that could
    # revoke them: copied even by default; the FULL graphs' static outputs are lent.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), Mix(), torch.nn.Linear(16, 8)).eval()
    platform = FakePlatform(lends=True)
    fast = ostinato.graphed(
        model,
        max_batch_size=8,
        mode="full_and_piecewise",
        splitting_ops=("ostinato_graphed_test::mix",),
        full_when=lambda x: x.shape[0] <= 4,
        compiler="eager",
        platform=platform,
    )
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    pieces = fast(x)  # PIECEWISE (6 rows)
    assert platform.lent == []
    fast(y)
    torch.testing.assert_close(pieces, eager(model, x), atol=1e-6, rtol=1e-5)
    full = fast(torch.randn(3, 8))  # FULL (3 rows): lent
    assert len(platform.lent) == 1 and full.data_ptr() == platform.lent[0].data_ptr()


def test_full_when_must_answer_a_bool():
    fast = ostinato.graphed(
        mlp(), mode="full_decode_only", full_when=lambda x: 1, platform=FakePlatform()
    )
    with pytest.raises(TypeError, match="full_when: must return a bool, returned int"):
        fast(torch.randn(2, 8))


def test_a_named_compiler_compiles_the_whole_function_once_for_every_bucket():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them: earlier tests' frames
    model, platform = mlp().eval(), FakePlatform()
    fast = ostinato.graphed(model, max_batch_size=8, compiler="eager", platform=platform)
    frames = torch._dynamo.utils.counters["frames"]
    for n in (3, 8, 1, 6):
        x = torch.randn(n, 8)
        torch.testing.assert_close(fast(x), eager(model, x), atol=1e-6, rtol=1e-5)
    assert fast.stats().replays == 4 and platform.graphs
    # The capture's warm-up compiled the largest bucket with a dynamic batch; size 1
    # is the only other variant Dynamo makes.
    assert 1 <= frames["ok"] <= 2


@contextlib.contextmanager
def device_held_elsewhere():
    """Inside, another thread holds graphed's device lock (as another signature's compile
    does)."""
    held, free = threading.Event(), threading.Event()

    def hold():
        with callable_graphs._DEVICE:
            held.set()
            free.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(30)
    try:
        yield
    finally:
        free.set()
        thread.join()


def test_background_capture_takes_one_graph_per_call_on_the_callers_thread():
    model, platform = mlp().eval(), FakePlatform()
    threads = capture_threads(platform)
    ladder = (1, 2, 4, 8)
    fast = ostinato.graphed(model, capture_sizes=ladder, platform=platform, capture="background")
    x = torch.randn(3, 8)
    for calls in range(1, 6):  # its own bucket (4), then one more a call
        torch.testing.assert_close(fast(x), eager(model, x))
        assert len(platform.graphs) == min(calls, 4)
    assert set(threads) == {threading.current_thread()}
    assert fast.stats().replays == 5 and fast.stats().eager == 0


def test_background_capture_runs_eagerly_while_the_device_is_held_or_after_a_failure():
    model = mlp().eval()
    fast = ostinato.graphed(model, max_batch_size=8, platform=FakePlatform(), capture="background")
    x = torch.randn(3, 8)
    with device_held_elsewhere():
        torch.testing.assert_close(fast(x), eager(model, x))
    assert fast.stats().eager == 1 and fast.stats().replays == 0
    torch.testing.assert_close(fast(x), eager(model, x))
    assert fast.stats().replays == 1
    broken = FakePlatform(fail_capture=RuntimeError("no capture today"))
    failing = ostinato.graphed(model, max_batch_size=8, platform=broken, capture="background")
    with pytest.warns(UserWarning, match="runs eagerly from now on"):
        torch.testing.assert_close(failing(x), eager(model, x))
    for _ in range(3):
        torch.testing.assert_close(failing(x), eager(model, x))
    assert failing.stats().replays == 0 and failing.stats().eager == 4


def test_a_staged_signature_serves_at_once_and_moves_buckets_to_its_compiled_graphs(
    monkeypatch,
):
    # capture="staged": FULL graphs of the model as it is serve the first call; a thread
    # compiles it whole ("eager" here: Dynamo's trace, no Inductor on the CPU) and captures
    # its graphs, each bucket moved where timed faster (a timer that favours the upgrade
    # up to 4 rows). Outputs equal eager before, during and after; the buckets above 4
    # stay on the first stage, and stats() says how the upgrade ended. Every graph is
    # captured on the caller's thread (the thread only compiles), and the measurements'
    # replays count nowhere.
    import threading

    from ostinato import staged

    real = staged.wall_timer

    def timer(runtime, dispatch, rows, meta):
        seconds = real(runtime, dispatch, rows, meta)
        return 0.0 if runtime is not first[0] and rows <= 4 else seconds + 1.0

    monkeypatch.setattr(staged, "wall_timer", timer)
    model, platform = mlp().eval(), FakePlatform()
    captured_on, real_capture = set(), platform.capture

    def capture(graph, pool):
        captured_on.add(threading.current_thread())
        return real_capture(graph, pool)

    platform.capture = capture
    fast = ostinato.graphed(
        model, capture_sizes=(1, 2, 4, 8), platform=platform, capture="staged", compiler="eager"
    )
    x = torch.randn(3, 8)
    first = []
    torch.testing.assert_close(fast(x), eager(model, x), atol=1e-6, rtol=1e-5)
    (sig,) = fast._signatures.values()
    first.append(sig.runtime)
    assert fast.wait_for_upgrades(timeout=120), fast.stats().summary()
    assert sig.staged.error is None, sig.staged.summary()
    assert {d.num_tokens for d in sig.staged.upgraded} == {1, 2, 4}
    upgrade = sig.staged.upgrade.manager
    assert upgrade.stats().replays == 0 and sig.runtime.manager.stats().replays == 1
    for n in (1, 3, 4, 5, 8, 11):
        x = torch.randn(n, 8)
        torch.testing.assert_close(fast(x), eager(model, x), atol=1e-6, rtol=1e-5)
    assert upgrade.stats().replays == 3  # the calls of 1, 3 and 4 rows
    assert fast.stats().replays == 6 and fast.stats().eager == 1  # (both stages; 11 rows)
    assert captured_on == {threading.current_thread()}
    assert "3 of 4 buckets measured faster and moved" in fast.stats().summary()
    fast.release()


def test_staged_capture_is_refused_where_there_is_nothing_to_upgrade():
    with pytest.raises(ValueError, match="compiler: capture='staged' compiles fn"):
        ostinato.graphed(mlp(), capture="staged", compiler=None)
    with pytest.raises(ValueError, match="capture: 'staged' upgrades FULL graphs"):
        ostinato.graphed(mlp(), capture="staged", mode="piecewise", splitting_ops=["a::b"])


@pytest.mark.parametrize(
    ("kwargs", "when"),
    [
        ({}, "staged"),  # the default: graphs at once, Inductor's swapped in
        ({"mode": "full"}, "staged"),
        ({"compiler": "inductor"}, "first_use"),  # a named compiler from the first graph
        ({"compiler": "eager"}, "first_use"),
        ({"compiler": None}, "first_use"),
        ({"mode": "piecewise", "splitting_ops": ["a::b"]}, "first_use"),
        ({"mode": "none"}, "first_use"),
        ({"capture": "background"}, "background"),
    ],
)
def test_the_default_capture_is_staged_where_an_upgrade_applies(kwargs, when):
    assert ostinato.graphed(mlp(), **kwargs).options.capture == when


def test_the_default_ladder_has_a_graph_for_every_size_to_32_then_steps_of_8():
    def ladder(**kwargs):
        fast = ostinato.graphed(mlp(), platform=FakePlatform(), **kwargs)
        return fast.options.config.capture_sizes

    assert ladder() == (*range(1, 33), 40, 48, 56, 64)
    assert ladder(max_batch_size=20) == tuple(range(1, 21))
    assert ladder(max_batch_size=50) == (*range(1, 33), 40, 48, 50)
    assert ladder(capture_sizes=[1, 8]) == (1, 8)


def test_without_graphs_the_staged_default_runs_eagerly_and_starts_no_compile():
    # The CPU platform has no graphs: the default neither captures nor compiles.
    fast = ostinato.graphed(mlp(), max_batch_size=8, platform=CpuPlatform())
    x = torch.randn(3, 8)
    with pytest.warns(UserWarning, match="every call runs eagerly"):
        torch.testing.assert_close(fast(x), eager(fast.fn, x))
    (sig,) = fast._signatures.values()
    assert sig.staged is None and fast.wait_for_upgrades(0)


def test_a_signature_whose_capture_would_overlap_an_upgrades_compile_runs_eagerly_until_free():
    # While an upgrade's thread runs its compiler (it holds the device lock: its
    # autotuning synchronizes the device, which no capture may overlap), a new
    # signature's calls run eagerly instead of waiting; wait_for_upgrades (or the first
    # call after the compile ends) captures it. stats() counts both.
    model = mlp().eval()
    fast = ostinato.graphed(model, max_batch_size=8, platform=FakePlatform(), capture="first_use")
    x = torch.randn(3, 8)
    with device_held_elsewhere():
        torch.testing.assert_close(fast(x), eager(fast.fn, x))
        assert fast.stats().eager_device_busy == 1 and fast.stats().replays == 0
    assert fast.wait_for_upgrades(5)  # captures the waiting signature
    (sig,) = fast.stats().signatures
    assert all(b.capture_seconds > 0 for b in sig.stats.buckets)
    torch.testing.assert_close(fast(x), eager(fast.fn, x))
    assert (
        fast.stats().replays == 1 and "the capture waited for the device" in fast.stats().summary()
    )
    fast.release()


class PerToken(torch.nn.Module):
    """Token embeddings and one linear layer: any length, the padding tokens apart."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, ids):
        return self.proj(self.embed(ids))


def test_signatures_that_differ_only_in_their_bucket_share_one_compilation():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = PerToken().eval()
    torch._dynamo.reset()
    counters.clear()
    fast = ostinato.graphed(
        model,
        max_batch_size=8,
        seq_buckets=(4, 8, 16),
        compiler="eager",
        capture="first_use",
        platform=FakePlatform(),
    )
    graphs = []
    for n, length in [(2, 3), (5, 7), (3, 16), (8, 2)]:
        ids = torch.randint(0, 50, (n, length))
        torch.testing.assert_close(fast(ids), eager(model, ids), atol=1e-6, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    signatures = list(fast._signatures.values())
    assert len(signatures) == 3  # one per bucket
    assert len({id(s._compiled) for s in signatures}) == 1  # one compilation among them
    # The first bucket's ladder compiled (a batch of 1 apart: Dynamo specializes it);
    # the others traced nothing new: the sequence was dynamic from the start.
    assert graphs[0] >= 1 and graphs[1:] == [graphs[0]] * 3
    other = ostinato.graphed(
        model, max_batch_size=8, compiler="eager", capture="first_use", platform=FakePlatform()
    )
    other(torch.randint(0, 50, (2, 3)))
    other(torch.randint(0, 50, (2, 5)))  # no buckets: each length is a family of its own
    assert len({id(s._compiled) for s in other._signatures.values()}) == 2


def _per_position(ids):
    """A sequence model's shape of output: ``[batch, seq, 5]`` (logits-like) and a pooled
    ``[batch, 5]``."""
    h = torch.tanh(ids[..., :5] * 2 + ids.sum(-1, keepdim=True))
    return h, h.sum(1)  # (padding positions give tanh(0) = 0: the sum ignores them)


def test_every_graphed_callable_of_a_platform_captures_into_one_pool():
    # No output buffer beside the pool: every bucket's graphs, and another callable's,
    # capture into the platform's one pool for graphed (its lender's), and each call
    # returns its graph's own outputs from there.
    platform = FakePlatform()
    fast = ostinato.graphed(
        _per_position, max_batch_size=4, seq_buckets=(4, 8, 16), platform=platform,
        capture="first_use",
    )  # fmt: skip
    other = ostinato.graphed(
        _per_position, max_batch_size=2, platform=platform, capture="first_use"
    )
    for length in (3, 12, 7, 16, 1):
        ids = torch.randn(3, length, 6)
        torch.testing.assert_close(fast(ids), eager(_per_position, ids))
    ids = torch.randn(2, 5, 6)
    torch.testing.assert_close(other(ids), eager(_per_position, ids))
    signatures = [s for g in (fast, other) for s in g._signatures.values()]
    assert sorted(s.bucket for s in signatures) == [0, 4, 8, 16]
    assert {s.runtime.manager.pool for s in signatures} == {("pool", 1)}
    assert platform.pools == 1
    assert len(platform.graphs) == 3 * 4 + 2


def test_a_call_of_another_graphed_callable_on_the_platform_recalls_what_this_one_lent():
    # The two share the pool, so the other's replay may overwrite this one's outputs:
    # its call recalls them (an argument lent by the first is read before that).
    platform = FakePlatform(lends=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval()
    first = ostinato.graphed(model, max_batch_size=4, platform=platform, capture="first_use")
    second = ostinato.graphed(model, max_batch_size=4, platform=platform, capture="first_use")
    x = torch.randn(3, 8)
    out = first(x)
    assert platform.revoked == []
    again = second(out)  # (its first call: the capture writes the pool)
    torch.testing.assert_close(again, eager(model, eager(model, x)))
    assert [i for i, _ in platform.revoked] == [0]
    kept = second(x)
    assert [i for i, _ in platform.revoked] == [0, 1]
    first.release()  # (recalls the first's loans only: it has none left)
    assert [i for i, _ in platform.revoked] == [0, 1]
    second.release()
    assert [i for i, _ in platform.revoked] == [0, 1, 2] and kept.shape == (3, 8)


def test_two_threads_calling_two_buckets_get_their_own_outputs():
    # The buckets' outputs share storage, so a call holds it from its replay until its
    # outputs are copied: threads calling two buckets at once each get their own answer.
    fast = ostinato.graphed(
        _per_position, max_batch_size=4, seq_buckets=(4, 16), platform=FakePlatform(),
        capture="first_use",
    )  # fmt: skip
    errors = []

    def calls(length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        try:
            for _ in range(100):
                ids = torch.randn(2, length, 6, generator=g)
                torch.testing.assert_close(fast(ids), eager(_per_position, ids))
        except AssertionError as exc:  # (raised in a thread: kept for the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=calls, args=(n, n)) for n in (3, 13)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_an_upgrades_captures_wait_for_the_shared_outputs():
    # wait_for_upgrades captures and times the upgrade's buckets on its caller's thread,
    # writing the pool every graphed callable shares: while another thread's call
    # holds it (here: the test holds its lock), it waits, then finishes.
    model = mlp().eval()
    fast = ostinato.graphed(
        model, max_batch_size=8, platform=FakePlatform(), capture="staged", compiler="eager"
    )
    fast(torch.randn(3, 8))
    (sig,) = fast._signatures.values()
    sig.staged._thread.join()  # (the upgrade built: what is left is captures and timings)
    waiter = threading.Thread(target=fast.wait_for_upgrades, kwargs={"timeout": 120})
    with sig.lender.lock:
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not sig.staged.done
    waiter.join()
    assert sig.staged.done and sig.staged.error is None, sig.staged.summary()
    x = torch.randn(5, 8)
    torch.testing.assert_close(fast(x), eager(model, x), atol=1e-6, rtol=1e-5)
    fast.release()
