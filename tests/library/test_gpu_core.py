"""GPU tests of the core runtime: capture, replay, padding, pool, guards, diagnostics."""

import gc
import random

import pytest
import torch

from ostinato import (
    BatchDescriptor,
    CaptureNotAllowedError,
    Dispatcher,
    GraphCaptureError,
    GraphConfig,
    GraphManager,
    GraphMode,
    GraphOptions,
    GraphWrapper,
    InputAddressChangedError,
    capture_phase,
    forward_context,
)
from ostinato.engine.cli.demo import TinyModel, TinyRunner

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
VOCAB = 1000


@pytest.fixture(scope="module")
def captured():
    """A 4-block bf16 model captured at every size of the default ladder (1..512)."""
    torch.manual_seed(0)
    model = TinyModel(vocab=VOCAB, hidden=1024, intermediate=2048, layers=4)
    model = model.to(DEVICE, torch.bfloat16).eval()
    config = GraphConfig(mode=GraphMode.FULL, verify_graphs=True)  # each graph checked vs eager
    # A pool of its own: the shared one may already hold memory from earlier tests, and
    # the pool-size checks below measure what this capture reserves.
    pool = torch.cuda.graph_pool_handle()
    runner = TinyRunner(model, config, DEVICE, progress=False, pool=pool)
    runner.capture()
    return model, runner


def test_every_ladder_size_captured_into_one_pool(captured):
    model, runner = captured
    report = runner.graphs.manager.report
    assert runner.graphs.manager.num_graphs == len(GraphConfig().sizes) >= 50
    assert report.num_graphs == runner.graphs.manager.num_graphs
    sizes = [r.descriptor.num_tokens for r in report.records]
    assert sizes == sorted(sizes, reverse=True), "largest first"
    # Graph memory is real, and bounded: the pool is shared, so 51 graphs cost about
    # one largest graph's intermediates (512 x 4096 bf16 = 4 MiB each), not 51 of them.
    assert 0 < report.pool_bytes < 64 * 2**20, report.summary()
    assert report.device_bytes < 256 * 2**20, report.summary()
    # The first (largest) capture reserves the pool; the rest mostly reuse it.
    assert report.records[0].pool_bytes >= max(r.pool_bytes for r in report.records[1:])


def test_replay_bitwise_equals_eager_on_padded_input_random_sizes(captured):
    model, runner = captured
    rng = random.Random(1234)
    for n in [1, 2, 3, 511, 512] + [rng.randint(1, 512) for _ in range(40)]:
        ids = torch.randint(0, VOCAB, (n,), device=DEVICE)
        with torch.inference_mode():
            got = runner.forward(ids).clone()
            plan = runner.graphs.dispatch(n)
            padded = runner.input_ids[: plan.padded_tokens].clone()
            want_padded = model(padded)[:n]
            want = model(ids)
        assert got.shape == (n, 1024)
        assert torch.equal(got, want_padded), f"n={n}: replay differs from eager bitwise"
        # The unpadded eager run may pick other GEMM kernels: equal within bf16 rounding.
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_padding_rows_do_not_leak_into_real_rows(captured):
    model, runner = captured
    n = 37
    ids = torch.randint(0, VOCAB, (n,), device=DEVICE)
    with torch.inference_mode():
        first = runner.forward(ids).clone()
        plan = runner.graphs.dispatch(n)
        runner.input_ids[n : plan.padded_tokens].random_(0, VOCAB)  # garbage padding
        runner.input_ids[:n].copy_(ids)
        second = runner.graphs.manager.run(plan, n).clone()
    assert torch.equal(first, second)


def test_above_largest_size_runs_eagerly(captured):
    model, runner = captured
    ids = torch.randint(0, VOCAB, (600,), device=DEVICE)
    with torch.inference_mode():
        assert runner.graphs.dispatch(600).mode is GraphMode.NONE
        torch.testing.assert_close(runner.forward(ids), model(ids))


def test_stats_count_each_replay_and_its_padding(captured):
    model, runner = captured
    manager = runner.graphs.manager
    before = {(b.descriptor, b.mode): b for b in manager.stats().buckets}
    sizes = [3, 3, 100, 512]
    with torch.inference_mode():
        for n in sizes:
            runner.forward(torch.randint(0, VOCAB, (n,), device=DEVICE))
    stats = manager.stats()
    grew = {
        b.descriptor.num_tokens: (b.replays - before[(b.descriptor, b.mode)].replays, b)
        for b in stats.buckets
        if b.replays != before[(b.descriptor, b.mode)].replays
    }
    pad = {n: runner.graphs.dispatch(n).padded_tokens for n in (3, 100, 512)}
    assert {size: count for size, (count, _) in grew.items()} == {pad[3]: 2, pad[100]: 1, 512: 1}
    assert all(b.capture_seconds > 0 and b.pool_bytes >= 0 for _, b in grew.values())
    assert stats.eager == 0  # (this runner runs sizes above the ladder without the manager)
    assert "padding" in stats.summary()


def _linear_wrapper(options):
    lin = torch.nn.Linear(64, 64, device=DEVICE)
    return lin, GraphWrapper(lin, GraphMode.FULL, options=options)


@torch.inference_mode()
def test_wrapper_capture_replay_and_weak_output():
    lin, w = _linear_wrapper(GraphOptions(check_addresses=True))
    x = torch.randn(8, 64, device=DEVICE)
    d = BatchDescriptor(8)
    with capture_phase(), forward_context(GraphMode.FULL, d):
        w(x)
    x.copy_(torch.randn(8, 64, device=DEVICE))
    with forward_context(GraphMode.FULL, d):
        out = w(x)
    assert torch.equal(out, lin(x))
    assert out.data_ptr() == w.entries[d].output.data_ptr()


@torch.inference_mode()
def test_wrapper_address_change_error_names_argument():
    lin, w = _linear_wrapper(GraphOptions(check_addresses=True))
    x = torch.randn(8, 64, device=DEVICE)
    with capture_phase(), forward_context(GraphMode.FULL, BatchDescriptor(8)):
        w(x)
    with (
        forward_context(GraphMode.FULL, BatchDescriptor(8)),
        pytest.raises(InputAddressChangedError, match="input argument #0 was at 0x"),
    ):
        w(torch.randn(8, 64, device=DEVICE))


@torch.inference_mode()
def test_capture_outside_capture_phase_is_refused():
    lin, w = _linear_wrapper(GraphOptions())
    with forward_context(GraphMode.FULL, BatchDescriptor(8)), pytest.raises(CaptureNotAllowedError):
        w(torch.randn(8, 64, device=DEVICE))
    assert w.entries == {}


def _syncs_on_the_device(x):
    y = x * 2
    if y.sum().item() > 1e9:  # a host sync: illegal while capturing
        y = y + 1
    return y


@torch.inference_mode()
def test_capture_error_names_the_syncing_op_and_line_then_device_still_works():
    w = GraphWrapper(_syncs_on_the_device, GraphMode.FULL, options=GraphOptions(lazy_capture=True))
    x = torch.randn(16, device=DEVICE)
    with (
        forward_context(GraphMode.FULL, BatchDescriptor(16)),
        pytest.raises(GraphCaptureError) as err,
    ):
        w(x)
    msg = str(err.value)
    assert "test_gpu_core.py" in msg and "_syncs_on_the_device" in msg and ".item()" in msg
    assert w.entries == {}
    # The failed capture left the device usable: eager ops, the RNG, and the shared pool,
    # into which the next capture must still succeed.
    torch.testing.assert_close(x * 2, _syncs_on_the_device(x))
    assert torch.randn(4, device=DEVICE).isfinite().all()
    lin, ok = _linear_wrapper(GraphOptions(lazy_capture=True))
    y = torch.randn(8, 64, device=DEVICE)
    with forward_context(GraphMode.FULL, BatchDescriptor(8)):
        ok(y)
        assert torch.equal(ok(y), lin(y))


@torch.inference_mode()
def test_full_decode_only_separate_uniform_graphs_and_aux_outputs():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 32, device=DEVICE)
    x = torch.zeros(64, 32, device=DEVICE)
    cfg = GraphConfig(mode=GraphMode.FULL_DECODE_ONLY, capture_sizes=(1, 2, 4, 8, 16, 32, 64))
    dispatcher = Dispatcher(cfg, max_num_reqs=32)
    m = GraphManager(
        lambda d: (lin(x[: d.num_tokens]), x[: d.num_tokens].sum(-1)), dispatcher, progress=False
    )
    m.capture()
    assert m.num_graphs == 6  # uniform decode sizes 1..32 only
    x[:5] = torch.randn(5, 32, device=DEVICE)
    plan = m.dispatcher.dispatch(5, uniform_decode=True)
    assert plan.mode is GraphMode.FULL and plan.descriptor == BatchDescriptor(8, 8, True)
    out, aux = m.run(plan, 5)
    assert torch.equal(out, lin(x[:8])[:5]) and torch.equal(aux, x[:8].sum(-1)[:5])
    mixed = m.dispatcher.dispatch(5, uniform_decode=False)
    assert mixed.mode is GraphMode.NONE
    out, aux = m.run(mixed, 5)
    assert out.shape == (5, 32)


@torch.inference_mode()
def test_pool_outlives_its_graphs():
    # Destroying every graph of a pool must not invalidate the pool for later captures.
    from ostinato import current_platform

    platform = current_platform()
    pool = platform.graph_pool_handle()
    x = torch.randn(32, device=DEVICE)
    for round_ in range(3):
        lin = torch.nn.Linear(32, 32, device=DEVICE)
        w = GraphWrapper(lin, GraphMode.FULL, pool=pool, options=GraphOptions(lazy_capture=True))
        with forward_context(GraphMode.FULL, BatchDescriptor(1)):
            w(x[None])
            assert torch.equal(w(x[None]), lin(x[None])), round_
        w.reset()
        del w, lin


def test_each_capture_and_pool_keeper_pauses_the_collector_and_only_there():
    # A background capture runs with the collector on (``capture_phase``); each capture
    # must still pause it: a collection's finalizers may empty the cache mid-capture.
    from ostinato import current_platform

    platform = current_platform()
    x = torch.randn(8, device=DEVICE)
    graph, inside = torch.cuda.CUDAGraph(), []
    assert gc.isenabled()
    pool = platform.graph_pool_handle()  # (its keeper graph captured with it paused)
    assert gc.isenabled()
    with platform.capture(graph, pool):
        inside.append(gc.isenabled())
        y = x * 2
    assert inside == [False] and gc.isenabled()
    x.fill_(3.0)
    graph.replay()
    assert torch.equal(y, torch.full_like(x, 6.0))


def test_a_pools_segments_asked_alone_are_those_of_the_whole_snapshot():
    # pool_segments asks torch for one pool's segments (no traces) where it takes a
    # pool: the same segments the whole snapshot holds for that pool, two pools apart.
    from ostinato.platform.cuda import CudaPlatform, pool_segments

    platform = CudaPlatform()
    pools = [platform.graph_pool_handle(), platform.graph_pool_handle()]
    x, kept = torch.ones(1 << 20, device="cuda"), []
    for pool, n in zip(pools, (1, 3), strict=True):
        graph = platform.new_graph()
        with platform.capture(graph, pool):
            kept.append([x * i for i in range(n)])  # (graph-owned outputs, kept alive)
        kept.append(graph)
    for pool in pools:
        segments = torch.cuda.memory_snapshot()
        whole = [s for s in segments if tuple(s["segment_pool_id"]) == tuple(pool)]
        alone = pool_segments(pool)
        assert sorted(s["address"] for s in alone) == sorted(s["address"] for s in whole)
        assert platform.pool_bytes(pool) == sum(s["total_size"] for s in whole) > 0


def test_a_pool_made_in_inference_mode_survives_a_failed_capture_outside_it():
    # The pool's keeper buffer is made at the first pool; the recovery from a failed
    # capture makes another pool, here outside inference mode.
    from ostinato.platform.cuda import CudaPlatform

    platform = CudaPlatform()
    with torch.inference_mode():
        pool = platform.graph_pool_handle()
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError):
        with platform.capture(platform.new_graph(), pool):
            (x * 2).sum().item()  # a host sync: the capture fails
    graph = platform.new_graph()
    with platform.capture(graph, pool):  # the retired pool's replacement
        y = x * 3
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 3.0))


@torch.inference_mode()
def test_a_blocking_capture_leaves_no_cublas_workspace_behind(monkeypatch):
    # cuBLAS keeps a workspace (32 MiB on Hopper) per (thread's handle, stream); one made
    # inside a capture would stay allocated in the graph's pool for good. A blocking
    # capture makes it one of the pool's temporaries, and graphs sharing the pool (and
    # so that memory) still replay right, one after the other.
    import threading

    from ostinato.platform import cuda
    from ostinato.platform.cuda import CudaPlatform

    # (as in a process where nothing captured beside steps; earlier tests' graphs are gone)
    monkeypatch.setattr(cuda, "_KEPT_WORKSPACES", threading.Event())
    platform = CudaPlatform()
    pool = platform.graph_pool_handle()
    a, b = (torch.randn(512, 512, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    a @ b  # this thread's eager workspace (dropped by the capture, made again below)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graphs, outs = [], []
    for w in (a, b):
        graph = platform.new_graph()
        with platform.capture(graph, pool):
            outs.append(w @ b)
        graphs.append(graph)
    grown = torch.cuda.memory_allocated() - before
    assert grown <= sum(o.numel() * o.element_size() for o in outs), f"{grown / 2**20:.1f} MiB"
    for _ in range(3):
        a.normal_()
        b.normal_()
        for graph in graphs:
            graph.replay()
        torch.testing.assert_close(outs[0], a @ b)
        torch.testing.assert_close(outs[1], b @ b)
    del graphs, outs
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before  # (the eager workspace made again)


def test_a_timing_capture_keeps_the_allocators_cached_blocks():
    # torch.cuda.graph empties the device's cache at every capture: each timing of a
    # measurement beside the steps would free their cached blocks (a wait on the device)
    # and make the steps allocate them again. captured_calls does not.
    from ostinato.platform.cuda import captured_calls

    x = torch.randn(256, 256, device=DEVICE)
    x @ x  # cuBLAS's lazy set-up outside the capture
    cached = torch.empty(64 << 20, dtype=torch.uint8, device=DEVICE)
    del cached  # a block the allocator keeps for the next allocation
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    graph = captured_calls(lambda: x @ x, 4)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() >= reserved
    del graph


def test_a_measurements_timing_graphs_leave_about_one_graphs_memory_behind():
    # Each timing graph in a pool of its own left its memory cached once deleted, freed
    # only by an emptied cache (the 8 B shape's GEMM plans: 41 GiB, and an H100's 80 GB
    # ran out inside a capture). In one timing_pool, 24 timings hold about one's memory,
    # freed as it ends; a timing alone frees its own as it returns.
    from ostinato.platform.cuda import graph_call_us, timing_pool

    x = torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16)
    x @ x  # cuBLAS's lazy set-up outside the captures
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    one = x.numel() * x.element_size()  # 32 MiB: a call's output, in its graph's pool
    with timing_pool():
        for _ in range(24):
            graph_call_us(lambda: x @ x, 2)
        held = torch.cuda.memory_reserved() - base
    left = torch.cuda.memory_reserved() - base
    graph_call_us(lambda: x @ x, 2)
    alone = torch.cuda.memory_reserved() - base
    assert one <= held < 4 * one, held / one
    assert left <= one // 4 and alone <= one // 4, (left / one, alone / one)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_timings_on_a_device_other_than_the_current_one_have_a_pool_there():
    # An engine measures on its own device (``torch.cuda.device``), which need not be the
    # current one: its timing graphs take a pool made on that device (a pool made on the
    # current one had none there to hold it, and the second capture failed an assert).
    from ostinato.platform.cuda import graph_call_us, timing_pool

    other = torch.device("cuda", 1 - torch.cuda.current_device())
    x = torch.randn(512, 512, device=other)
    with timing_pool():
        with torch.cuda.device(other):
            x @ x
            times = [graph_call_us(lambda: x @ x, 4) for _ in range(3)]
        here = torch.randn(512, 512, device=DEVICE)
        here @ here
        times.append(graph_call_us(lambda: here @ here, 4))
    assert all(t > 0 for t in times), times


@pytest.mark.parametrize("held_us", [1e9, 1.0])
def test_a_timing_held_per_replay_captures_beside_another_threads_work(monkeypatch, held_us):
    # A background GEMM measurement captures its timing graph while steps run on the
    # engine's thread (thread-local capture), then holds the step turn one timed replay
    # at a time (after one held replay of one call: how many calls a replay takes): the
    # capture must survive the other thread's launches, allocations and stream syncs,
    # and the time must agree with the plain measurement, whether a replay takes all 20
    # calls or one (``HELD_REPLAY_US`` below any call: four times the replays).
    import contextlib
    import threading
    import time

    from ostinato.platform import cuda
    from ostinato.platform.base import isolated_capture
    from ostinato.platform.cuda import graph_call_us

    monkeypatch.setattr(cuda, "HELD_REPLAY_US", held_us)

    # One call per replay only where a call is long (a graph's own launch, a few µs on
    # the device, would weigh on a short one): 2048 rows then, about 0.3 ms a call.
    n = 512 if held_us > 1 else 2048
    x = torch.randn(n, n, device=DEVICE)
    stop, steps = threading.Event(), [0]

    def steps_beside() -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            y = torch.randn(256, 256, device=DEVICE)
            while not stop.is_set():
                y = (y @ y).clamp_(-1, 1)  # a new tensor each time: the default pool
                stream.synchronize()
                steps[0] += 1

    holds = []

    @contextlib.contextmanager
    def turn():
        holds.append(steps[0])
        yield

    x @ x  # cuBLAS's lazy set-up on this thread, which a capture must not hold
    plain = graph_call_us(lambda: x @ x, 20)
    thread = threading.Thread(target=steps_beside)
    thread.start()
    while steps[0] == 0 and thread.is_alive():  # its own set-up done before a capture
        time.sleep(0.001)
    try:
        with isolated_capture():
            held = [graph_call_us(lambda: x @ x, 20, turn=turn) for _ in range(3)]
    finally:
        stop.set()
        thread.join()
    assert len(holds) == 3 * (1 + (5 if held_us > 1 else 20)) and steps[0] > 0, len(holds)
    assert all(0.5 * plain < us < 2.0 * plain for us in held), (plain, held)


def test_a_held_timing_lets_go_before_its_calls_end_and_times_them_alone():
    # CudaPlatform.held_seconds (the recapture choice's timer): the hold is let go once
    # the calls are queued, the device still running them (a step waits for the queueing,
    # not for the calls), and the time is theirs: not the work queued before the hold,
    # three calls about three times one.
    import contextlib

    from ostinato.platform.cuda import CudaPlatform

    platform = CudaPlatform()
    x = torch.randn(2048, 2048, device=DEVICE)
    x @ x
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x @ x  # (cuBLAS's set-up on the capture stream)
        graph.capture_begin()
        for _ in range(8):
            x @ x
        graph.capture_end()
    torch.cuda.synchronize()
    one = platform.held_seconds(graph.replay, 1, contextlib.nullcontext)
    busy_at_release = []

    @contextlib.contextmanager
    def held():
        yield
        busy_at_release.append(not torch.cuda.current_stream().query())

    for _ in range(16):
        x @ x  # queued before the hold: not the calls' time
    after_work = platform.held_seconds(graph.replay, 1, held)
    three = platform.held_seconds(graph.replay, 3, held)
    assert busy_at_release == [True, True]
    assert 0.7 * one < after_work < 1.4 * one, (one, after_work)
    assert 2.4 * one < three < 3.6 * one, (one, three)


def test_a_background_capture_records_beside_steps_that_stay_right(monkeypatch):
    # CUDA records without running anything, so a background FULL capture lets go of the
    # step turn while it records: steps run, replaying or eager, inside recordings (none
    # could while the turn was held), and each matches the eager model. float32.
    import threading

    from ostinato.graph import GraphWrapper

    torch.manual_seed(0)
    model = TinyModel(vocab=VOCAB, hidden=256, intermediate=512, layers=24)  # long recordings
    model = model.to(DEVICE).eval()
    config = GraphConfig(mode=GraphMode.FULL, capture_sizes=(1, 2, 4, 8, 16, 32, 64))
    runner = TinyRunner(model, config, DEVICE, progress=False)
    manager = runner.graphs.manager
    recording = threading.Event()
    real = GraphWrapper._record

    def record(self, graph, args, kwargs):
        recording.set()
        try:
            return real(self, graph, args, kwargs)
        finally:
            recording.clear()

    monkeypatch.setattr(GraphWrapper, "_record", record)
    ids = torch.randint(0, VOCAB, (64,), device=DEVICE)
    with torch.inference_mode():
        model(ids[:3])  # (cuBLAS's set-up on this thread first)
        background = manager.capture_in_background()
        beside, draw = 0, random.Random(3)
        while not background.done:
            n = draw.randint(1, 64)
            with manager.stepping():
                out = runner.forward(ids[:n])
                beside += recording.is_set()
            torch.testing.assert_close(out, model(ids[:n]), atol=1e-4, rtol=1e-4)
    assert background.error is None and manager.num_graphs == 7
    assert beside > 0, background.summary()
    assert background.holds["captures"].count == 7
