"""Ascend: attention parameters updated inside captured graphs, against a fake torch_npu
(tests/fake_torch_npu.py) that records every call, checks the task-group protocol and
replays graphs op by op, so a task that was not updated replays the lengths of its
capture. No Ascend hardware ran any of this."""

import pytest
import torch
from fake_torch_npu import ProtocolError, installed
from fakes import FakePlatform, engine_on

from ostinato import use_platform
from ostinato.batch import BatchDescriptor
from ostinato.context import forward_context
from ostinato.engine import LLM, SamplingParams
from ostinato.engine.core.kv_cache import KVCache
from ostinato.engine.model.attention import AttentionMetadata, TorchAttention
from ostinato.engine.model.attention_op import StepAttention
from ostinato.graph import GraphOptions, GraphWrapper
from ostinato.modes import GraphMode
from ostinato.param_updates import UpdateOrder, capture_updatable
from ostinato.platform.cpu import CpuPlatform

ROWS, HEADS, KV_HEADS, DIM, BLOCK, TABLE = 4, 4, 2, 8, 4, 6


@pytest.fixture
def fake(monkeypatch):
    with installed(monkeypatch) as fake:
        yield fake


def npu_platform(order=UpdateOrder.SYNC_THEN_UPDATE):
    from ostinato.platform.npu import NpuPlatform  # imported against the fake

    return NpuPlatform(order)


class Step:
    """One attention layer over persistent buffers: ``ROWS`` rows of q/k/v, metadata
    buffers and a one-layer cache, run through ``ostinato::attention`` in a wrapper."""

    def __init__(self, platform, mode=GraphMode.FULL):
        from ostinato.engine.model.ascend_attention import AscendAttention

        torch.manual_seed(0)
        self.backend = AscendAttention()
        self.cache = KVCache(1, 1 + ROWS * TABLE, BLOCK, KV_HEADS, DIM, torch.float32, "cpu")
        self.q = torch.zeros(ROWS, HEADS, DIM)  # [rows, heads, dim]
        self.k = torch.zeros(ROWS, KV_HEADS, DIM)  # [rows, kv_heads, dim]
        self.v = torch.zeros(ROWS, KV_HEADS, DIM)
        self.out = torch.zeros(ROWS, HEADS, DIM)
        self.positions = torch.full((ROWS,), -1)  # [rows]
        self.token_req = torch.zeros(ROWS, dtype=torch.int32)  # [rows]
        self.slots = torch.zeros(ROWS, dtype=torch.long)  # [rows]
        self.tables = torch.zeros(ROWS, TABLE, dtype=torch.int32)  # [requests, blocks]
        self.wrapper = GraphWrapper(
            self.run, mode, options=GraphOptions(lazy_capture=True), platform=platform
        )

    def run(self):
        torch.ops.ostinato.attention(self.q, self.k, self.v, self.out, 0, DIM**-0.5)
        return self.out

    def metadata(self, seq_lens):
        """A decode step of ``len(seq_lens)`` requests (request r owns blocks after
        1 + r * TABLE), new q/k/v drawn, the rest of the rows padding."""
        n = len(seq_lens)
        for t in (self.q, self.k, self.v):
            t.normal_()
        self.positions.fill_(-1)
        self.slots.zero_()
        for r, length in enumerate(seq_lens):
            self.tables[r] = torch.arange(TABLE) + 1 + r * TABLE
            self.positions[r] = length - 1
            self.token_req[r] = r
            self.slots[r] = (1 + r * TABLE) * BLOCK + length - 1
        meta = AttentionMetadata(
            self.positions, self.token_req, self.slots, self.tables, [1] * n, list(seq_lens)
        )
        return StepAttention(meta, self.cache, self.backend)

    def call(self, mode, seq_lens):
        step = self.metadata(seq_lens)
        with forward_context(mode, BatchDescriptor(ROWS, uniform_decode=True), step):
            return self.wrapper().clone()

    def reference(self, seq_lens):
        """The step just run, through the torch backend (its real rows)."""
        n = len(seq_lens)
        m = AttentionMetadata(
            self.positions, self.token_req, self.slots, self.tables, [1] * n, list(seq_lens)
        )
        out = torch.zeros(ROWS, HEADS, DIM)
        TorchAttention()(self.q, self.cache.k[0], self.cache.v[0], m, DIM**-0.5, out)
        return out[:n]


def prefill_cache(step):
    for t in step.cache.k + step.cache.v:
        t.normal_()


STEPS = [[5, 9, 2], [7, 1], [13, 6, 3, 24], [2]]


@pytest.mark.parametrize("order", [UpdateOrder.SYNC_THEN_UPDATE, UpdateOrder.REPLAY_THEN_UPDATE])
def test_replays_run_each_step_with_its_own_lengths_in_either_order(fake, order):
    platform = npu_platform(order)
    s = Step(platform)
    prefill_cache(s)
    s.call(GraphMode.FULL, [])  # capture: padding only
    (entry,) = s.wrapper.entries.values()
    assert len(entry.tasks) == 1 and entry.tasks[0].name == "ascend attention"
    # Sized for the longest sequences the block table holds, once per captured size.
    assert fake.log.count(("workspace", [TABLE * BLOCK] * ROWS)) == 1
    for lens in STEPS:  # back to back: the host never waits between replays
        start = len(fake.log)
        got = s.call(GraphMode.FULL, lens)
        assert torch.allclose(got[: len(lens)], s.reference(lens), atol=1e-5)
        assert torch.all(got[len(lens) :] == 0)  # padding rows: requests with no keys
        events = [e[0] for e in fake.log[start:]]
        assert events.count("update_begin") == 1 and events.count("event_record") == 1
        assert ("task_runs", 0, [*lens, *[0] * (ROWS - len(lens))]) in fake.log[start:]
        update = events.index("update_begin")
        assert events[update : update + 4] == [
            "update_begin",
            "attention",
            "update_end",
            "event_record",
        ]
        replay = events.index("replay")
        if order is UpdateOrder.SYNC_THEN_UPDATE:
            assert events.index("sync") < update < replay
        else:  # launched first, updated while it waits, no host synchronize before
            assert events[0] == "fence" and replay < events.index("wait_event") < update
            assert "sync" not in events
    fake.synchronize()  # every replay ran to its end: nothing left blocked


def test_a_piecewise_piece_that_holds_the_op_registers_and_updates_it_alike(fake):
    # The engine splits its pieces at attention, which then runs eagerly between them;
    # a piece that does hold the op (another split, say) keeps it current the same way.
    s = Step(npu_platform(UpdateOrder.REPLAY_THEN_UPDATE), mode=GraphMode.PIECEWISE)
    prefill_cache(s)
    s.call(GraphMode.PIECEWISE, [])
    (entry,) = s.wrapper.entries.values()
    assert len(entry.tasks) == 1
    for lens in STEPS:
        got = s.call(GraphMode.PIECEWISE, lens)
        assert torch.allclose(got[: len(lens)], s.reference(lens), atol=1e-5)


def test_the_update_stream_is_a_side_stream_and_the_task_waits_on_its_own_event(fake):
    s = Step(npu_platform())
    s.call(GraphMode.FULL, [])
    capture = [e for e in fake.log if e[0] in ("event_wait", "event_reset", "group_begin")]
    assert [e[0] for e in capture] == ["event_wait", "event_reset", "group_begin"]
    assert capture[0][1] == capture[1][1]  # the same external event
    s.call(GraphMode.FULL, [3])
    (update,) = [e for e in fake.log if e[0] == "update_begin"]
    (record,) = [e for e in fake.log if e[0] == "event_record"]
    assert update[2] == record[2] != "main" and record[1] == capture[0][1]


def test_eager_steps_issue_the_op_directly_and_register_nothing(fake):
    s = Step(npu_platform())
    s.call(GraphMode.NONE, [3, 4])
    assert not s.wrapper.entries
    assert [e[:2] for e in fake.log if e[0] == "attention"] == [("attention", "eager")]
    assert not any(e[0] in ("group_begin", "update_begin", "workspace") for e in fake.log)


@pytest.mark.parametrize("platform", [FakePlatform(), CpuPlatform()], ids=["graphs", "cpu"])
def test_platforms_that_read_parameters_from_device_memory_register_nothing(platform):
    assert platform.update_order is UpdateOrder.NONE
    calls = []
    wrapper = GraphWrapper(
        lambda: capture_updatable(calls.append, "step", name="op"),
        GraphMode.FULL,
        options=GraphOptions(lazy_capture=True),
        platform=platform,
    )
    if not platform.supports_graphs:
        capture_updatable(calls.append, "step", name="op")
        assert calls == ["step"]
        return
    with forward_context(GraphMode.FULL, BatchDescriptor(2), "step"):
        wrapper()
        wrapper()
    assert calls == ["step"] and wrapper.entries[BatchDescriptor(2)].tasks == ()


def test_cuda_platform_updates_nothing():
    from ostinato.platform.base import Platform

    if torch.cuda.is_available():
        from ostinato.platform.cuda import CudaPlatform

        assert CudaPlatform().update_order is UpdateOrder.NONE
    assert Platform.update_order is UpdateOrder.NONE


# -- the fake catches what a wrong protocol would do on the device ---------------------


def test_a_replay_without_its_update_deadlocks_and_is_refused_without_step_metadata(fake):
    s = Step(npu_platform())
    s.call(GraphMode.FULL, [])
    d = BatchDescriptor(ROWS, uniform_decode=True)
    with pytest.raises(ValueError, match="host parameters .ascend attention.*no step metadata"):
        s.wrapper.replay(d)
    s.wrapper.entries[d].graph.replay()  # behind the runtime's back: no update
    with pytest.raises(ProtocolError, match="deadlock"):
        fake.synchronize()


@pytest.mark.parametrize(
    "order, planted, message",
    [  # the fence that orders updates after the previous replay, or the synchronize
        (UpdateOrder.REPLAY_THEN_UPDATE, "replay_fence", "overtake replay #1"),
        (UpdateOrder.SYNC_THEN_UPDATE, "synchronize", "overtake"),
    ],
)
def test_an_update_that_does_not_wait_for_the_previous_replay_is_caught(
    fake, order, planted, message
):
    platform = npu_platform(order)
    setattr(platform, planted, lambda: None)  # planted: updates no longer ordered
    s = Step(platform)
    s.call(GraphMode.FULL, [])
    s.call(GraphMode.FULL, [3])
    with pytest.raises(ProtocolError, match=message):
        s.call(GraphMode.FULL, [4])


def test_an_op_captured_outside_a_task_group_is_caught(fake):
    platform = npu_platform()
    platform.capture_task = lambda issue: (issue(), (None, None))[1]  # planted
    with pytest.raises(Exception, match="outside a task group"):
        Step(platform).call(GraphMode.FULL, [])


# -- the engine ------------------------------------------------------------------------


def engine(mode, backend, **kw):
    base = dict(
        model="tiny",
        device="cpu",
        dtype=torch.float32,
        max_model_len=128,
        max_num_seqs=8,
        max_capture_size=16,
        progress=False,
        seed=3,
        capture="blocking",  # (the replays are checked from the first step on)
    )
    return LLM(mode=mode, backend=backend, **{**base, **kw})


PROMPTS = [[(7 * i + 3 * j) % 500 + 4 for i in range(12 + 9 * j)] for j in range(5)]
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


def tokens(llm, prompts=PROMPTS):
    return [o.token_ids for o in llm.generate(prompts, PARAMS)]


def test_the_engine_gives_the_cpu_tokens_through_the_ascend_backend_eagerly(fake):
    from ostinato.engine.model.ascend_attention import AscendAttention

    want = tokens(engine("none", None))
    assert tokens(engine("none", AscendAttention())) == want
    assert any(e[:2] == ("attention", "eager") for e in fake.log)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("order", [UpdateOrder.SYNC_THEN_UPDATE, UpdateOrder.REPLAY_THEN_UPDATE])
def test_the_engine_replays_decode_graphs_with_updated_lengths_on_the_npu_platform(
    fake, monkeypatch, order, async_scheduling
):
    from ostinato.engine.model.ascend_attention import AscendAttention

    want = tokens(engine("none", None))
    platform = npu_platform(order)
    engine_on(monkeypatch, platform)
    with use_platform(platform):
        llm = engine("full", AscendAttention(), async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling is async_scheduling
        # Uniform single-token decode graphs only: the backend's support level.
        assert llm.mode.name == "FULL_DECODE_ONLY"
        layers = llm.config.num_layers
        graphs = llm.engine.runner.manager._full.entries
        assert graphs and all(len(e.tasks) == layers for e in graphs.values())
        for b in (1, 3, 5):
            start = len(fake.log)
            assert tokens(llm, PROMPTS[:b]) == want[:b]
            runs = [e for e in fake.log[start:] if e[0] == "task_runs"]
            updates = [e for e in fake.log[start:] if e[0] == "update_begin"]
            assert runs and len(updates) == len(runs)  # one update per task and replay
            assert all(e[2][:b] != [0] * b for e in runs)  # real lengths, not the capture's


def test_the_engine_without_updates_would_replay_the_lengths_of_the_capture(fake, monkeypatch):
    # What ostinato's npu platform did before: replay the graph, update nothing. The
    # fake device then blocks on the first task's event, as the real one would hang.
    from ostinato.engine.model.ascend_attention import AscendAttention

    platform = npu_platform()
    platform.update_tasks = lambda tasks, step, fence=None: None
    engine_on(monkeypatch, platform)
    with use_platform(platform):
        llm = engine("full", AscendAttention())
        with pytest.raises(ProtocolError, match="deadlock"):
            tokens(llm, PROMPTS[:2])


def test_the_npu_platform_and_backend_load_against_torch_npu_and_name_what_is_missing(
    fake, monkeypatch
):
    import sys
    from types import SimpleNamespace

    from ostinato.engine.model.ascend_attention import AscendAttention
    from ostinato.engine.model.backends import default_backend
    from ostinato.errors import PlatformError
    from ostinato.platform import load_platform

    platform = load_platform("npu")
    assert platform.update_order is UpdateOrder.SYNC_THEN_UPDATE and platform.sync_before_replay
    assert not npu_platform(UpdateOrder.REPLAY_THEN_UPDATE).sync_before_replay
    with pytest.raises(ValueError, match="must update them"):
        npu_platform(UpdateOrder.NONE)
    assert isinstance(default_backend(SimpleNamespace(type="npu")), AscendAttention)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(PlatformError, match="needs torch_npu"):
        AscendAttention()


def test_lengths_keep_one_request_per_row_for_decodes_and_refuse_a_mismatch():
    from ostinato.engine.model.ascend_attention import fia_lengths

    def meta(q, s, tables=4):
        empty = torch.zeros(0)
        return AttentionMetadata(empty, empty, empty, torch.zeros(tables, 2), q, s)

    decode = fia_lengths(meta([1, 1], [5, 9]), 4, table_capacity=4)
    assert (decode.query_ends, decode.kv_lens, decode.table_rows) == ([1, 2, 3, 4], [5, 9, 0, 0], 4)
    mixed = fia_lengths(meta([3, 1], [3, 8]), 6, table_capacity=4)
    assert (mixed.query_ends, mixed.kv_lens, mixed.table_rows) == ([3, 4, 6], [3, 8, 0], 3)
    wide = fia_lengths(meta([1] * 4, [2] * 4), 6, table_capacity=4)  # padded past the table
    assert (wide.query_ends, wide.kv_lens) == ([1, 2, 3, 4, 6], [2, 2, 2, 2, 0])
    with pytest.raises(ValueError, match="summing to 7.* 6 rows"):
        fia_lengths(meta([4, 3], [4, 3]), 6, table_capacity=4)
