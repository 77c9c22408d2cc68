"""A fake ``torch_npu`` for the CPU: the ACL-graph task API that Ascend's parameter updates
use, with its protocol checked, and the ops ``AscendAttention`` calls, computed in torch.

Graphs record as ``fakes.FakeGraph`` does (every aten op, re-run on the captured tensors
at replay, no Python), so a captured attention op would replay the host lengths it was
captured with, as on the device. On top of that:

- A task group (``graph_task_group_begin``/``end``) must follow a wait on, and a reset of,
  an ``ExternalEvent`` in the capture; the fused attention op may only be captured inside
  one. An update (``graph_task_update_begin``/``end`` on a side stream that is current)
  re-records the group's ops from the op issued again, which must keep the request count
  and the buffers of the capture and fit the workspace made at capture.
- A replay runs in launch order on the main stream and blocks at a task group whose
  event no update has recorded; ``record`` lets it go on. ``synchronize`` with a replay
  still blocked is a deadlock (``ProtocolError``).
- An update may not overtake an earlier replay of the same graph that the host has not
  synchronized with, nor the update stream waited for (an ``Event`` recorded on the main
  stream before that replay's launch): only the replay blocked on this very group may be
  in flight.

Every call is appended to ``FakeAscend.log`` as a tuple, for the tests to read.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from fakes import _Recorder, run_ops


class ProtocolError(AssertionError):
    """A call the device would hang on, run stale, or race on."""


class Stream:
    def __init__(self, fake: FakeAscend, name: str) -> None:
        self.fake = fake
        self.name = name
        self.covers = 0  # replays (by launch number) this stream has waited for

    def wait_event(self, event: Event) -> None:
        self.fake.log.append(("wait_event", self.name, event.upto))
        blocked = self.fake.blocked()
        if blocked is not None and blocked.number <= event.upto:
            raise ProtocolError(
                f"{self.name} waits for replay #{blocked.number}, which waits for an update "
                "on this stream: a fence must be taken before the launch it precedes"
            )
        self.covers = max(self.covers, event.upto)

    def __repr__(self) -> str:
        return self.name


class Event:
    """An ordinary event: recorded on the main stream, it stands for every replay
    launched so far."""

    def __init__(self, fake: FakeAscend) -> None:
        self.fake = fake
        self.upto = 0

    def record(self, stream: Stream) -> None:
        if stream is not self.fake.main:
            raise ProtocolError("the fake orders only events recorded on the main stream")
        self.upto = len(self.fake.replays)
        self.fake.log.append(("fence", self.upto))


class ExternalEvent:
    def __init__(self, fake: FakeAscend) -> None:
        self.fake = fake
        self.recorded = False
        self.id = len(fake.external_events)
        fake.external_events.append(self)

    def wait(self, stream: Stream) -> None:
        graph = self.fake.require_capture("ExternalEvent.wait")
        graph.waited = self
        self.fake.log.append(("event_wait", self.id))

    def reset(self, stream: Stream) -> None:
        graph = self.fake.require_capture("ExternalEvent.reset")
        if graph.waited is not self:
            raise ProtocolError("an external event is reset in a capture without its wait")
        graph.armed, graph.waited = self, None
        self.fake.log.append(("event_reset", self.id))

    def record(self, stream: Stream) -> None:
        if stream is self.fake.main:
            raise ProtocolError("an update's event is recorded on the update stream")
        self.recorded = True
        self.fake.log.append(("event_record", self.id, stream.name))
        self.fake.pump()


@dataclass
class TaskGroup:
    id: int
    graph: FakeNpuGraph
    event: ExternalEvent
    ops: list[Any] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)  # the op as captured, updated


@dataclass
class Handle:
    group: TaskGroup


class FakeNpuGraph:
    def __init__(self, fake: FakeAscend) -> None:
        self.fake = fake
        self.items: list[Any] = []  # recorded ops and task groups, in order
        self.open: TaskGroup | None = None
        self.waited: ExternalEvent | None = None
        self.armed: ExternalEvent | None = None

    @property
    def ops(self) -> list[Any]:  # where fakes._Recorder appends
        return self.open.ops if self.open is not None else self.items

    def replay(self) -> None:
        self.fake.launch(self)

    def reset(self) -> None:
        self.items.clear()


@dataclass
class Replay:
    graph: FakeNpuGraph
    number: int
    position: int = 0
    blocked_on: TaskGroup | None = None


class _Sink:
    def __init__(self) -> None:
        self.ops: list[Any] = []


class FakeAscend:
    """The state behind the fake ``torch.npu`` and ``torch_npu`` modules."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.main = Stream(self, "main")
        self.streams = [self.main]
        self.stack: list[Stream] = []  # streams made current (torch.npu.stream), innermost last
        self.capturing: FakeNpuGraph | None = None
        self.replays: list[Replay] = []
        self.queue: list[Replay] = []
        self.synchronized = 0  # replays the host has waited for
        self.external_events: list[ExternalEvent] = []
        self.groups: list[TaskGroup] = []
        self.updating: tuple[TaskGroup, _Recorder] | None = None
        self.workspaces: dict[int, int] = {}  # id(workspace) -> longest kv length it fits
        self.npu = _npu_module(self)
        self.torch_npu = _torch_npu_module(self)

    # -- streams, capture, replay ----------------------------------------------------

    def current_stream(self) -> Stream:
        return self.stack[-1] if self.stack else self.main

    @contextlib.contextmanager
    def stream(self, s: Stream) -> Iterator[None]:
        self.stack.append(s)
        try:
            yield
        finally:
            self.stack.pop()

    def require_capture(self, what: str) -> FakeNpuGraph:
        if self.capturing is None:
            raise ProtocolError(f"{what} outside a capture")
        return self.capturing

    @contextlib.contextmanager
    def graph(self, g: FakeNpuGraph, pool: Any = None) -> Iterator[None]:
        if self.capturing is not None:
            raise ProtocolError("nested capture")
        self.capturing = g
        self.log.append(("capture_begin",))
        try:
            with _Recorder(g):
                yield
        finally:
            self.capturing = None
        if g.open is not None:
            raise ProtocolError("a capture ended inside an open task group")
        self.log.append(("capture_end",))

    def launch(self, graph: FakeNpuGraph) -> None:
        if self.capturing is not None:
            raise ProtocolError("replay during a capture")
        replay = Replay(graph, len(self.replays) + 1)
        self.replays.append(replay)
        self.queue.append(replay)
        self.log.append(("replay", replay.number))
        self.pump()

    def blocked(self) -> Replay | None:
        return self.queue[0] if self.queue else None

    def pump(self) -> None:
        """Runs queued replays in order until one blocks on an unrecorded event."""
        with torch.inference_mode():
            while self.queue:
                replay = self.queue[0]
                items = replay.graph.items
                while replay.position < len(items):
                    item = items[replay.position]
                    if isinstance(item, TaskGroup):
                        if not item.event.recorded:
                            replay.blocked_on = item
                            return
                        item.event.recorded = False  # the captured reset
                        replay.blocked_on = None
                        self.log.append(("task_runs", item.id, item.calls[-1]["kv"]))
                        run_ops(item.ops)
                    else:
                        run_ops([item])
                    replay.position += 1
                self.queue.pop(0)

    def synchronize(self) -> None:
        self.pump()
        blocked = self.blocked()
        if blocked is not None:
            raise ProtocolError(
                f"deadlock: synchronize waits for replay #{blocked.number}, blocked at task "
                f"group {blocked.blocked_on.id} on an event that no update has recorded"
            )
        self.synchronized = len(self.replays)
        self.log.append(("sync",))

    # -- task groups and updates -----------------------------------------------------

    def group_begin(self, stream: Stream) -> None:
        graph = self.require_capture("graph_task_group_begin")
        if graph.armed is None:
            raise ProtocolError(
                "a task group captured without first waiting on and resetting an external "
                "event: its update could never be ordered before it"
            )
        group = TaskGroup(len(self.groups), graph, graph.armed)
        self.groups.append(group)
        graph.items.append(group)
        graph.open, graph.armed = group, None
        self.log.append(("group_begin", group.id, stream.name))

    def group_end(self, stream: Stream) -> Handle:
        graph = self.require_capture("graph_task_group_end")
        group = graph.open
        if group is None or len(group.calls) != 1:
            raise ProtocolError("a task group must hold exactly one fused attention call")
        graph.open = None
        self.log.append(("group_end", group.id))
        return Handle(group)

    def update_begin(self, stream: Stream, handle: Handle) -> None:
        group = handle.group
        if self.capturing is not None or self.updating is not None:
            raise ProtocolError("graph_task_update_begin inside a capture or another update")
        if stream is self.main or self.current_stream() is not stream:
            raise ProtocolError("updates run on a side stream made current (torch.npu.stream)")
        covered = max(self.synchronized, stream.covers)
        for replay in self.replays[covered:]:
            if replay.graph is group.graph and replay.blocked_on is not group:
                raise ProtocolError(
                    f"the update of task group {group.id} would overtake replay "
                    f"#{replay.number} of its graph, still in flight: synchronize first, or "
                    "make the update stream wait for an event taken before that launch"
                )
        recorder = _Recorder(_Sink())
        recorder.__enter__()
        self.updating = (group, recorder)
        self.log.append(("update_begin", group.id, stream.name))

    def update_end(self, stream: Stream) -> None:
        if self.updating is None:
            raise ProtocolError("graph_task_update_end without a begin")
        group, recorder = self.updating
        recorder.__exit__(None, None, None)
        if len(group.calls) < 2 or group.calls[-1]["update"] is not True:
            raise ProtocolError(f"the update of task group {group.id} issued no attention op")
        group.ops = recorder.graph.ops
        self.updating = None
        self.log.append(("update_end", group.id))

    def note_attention(self, call: dict[str, Any], workspace: torch.Tensor | None) -> None:
        """Where a fused attention call stands: captured in a group, an update, or eager."""
        if self.updating is not None:
            group = self.updating[0]
            first = group.calls[0]
            if (call["requests"], call["query"], call["out"]) != (
                first["requests"],
                first["query"],
                first["out"],
            ):
                raise ProtocolError("an update must keep the capture's requests and buffers")
            self._check_workspace(workspace, call)
            group.calls.append({**call, "update": True})
            self.log.append(("attention", "update", call["ends"], call["kv"]))
            return
        if self.capturing is not None:
            group = self.capturing.open
            if group is None:
                raise ProtocolError(
                    "fused attention captured outside a task group: the graph would replay "
                    "the lengths of the capture"
                )
            self._check_workspace(workspace, call)
            group.calls.append({**call, "update": False})
            self.log.append(("attention", "capture", call["ends"], call["kv"]))
            return
        self.log.append(("attention", "eager", call["ends"], call["kv"]))

    def _check_workspace(self, workspace: torch.Tensor | None, call: dict[str, Any]) -> None:
        if workspace is None or id(workspace) not in self.workspaces:
            raise ProtocolError("a captured attention task needs the workspace made for it")
        if max(call["kv"], default=0) > self.workspaces[id(workspace)]:
            raise ProtocolError("the workspace was sized for shorter sequences")


# -- the ops ---------------------------------------------------------------------------


def _attention(fake: FakeAscend, query, key, value, **kw) -> torch.Tensor:
    """TND paged attention, bottom-right causal (``sparse_mode=3``), from host lengths."""
    if kw["input_layout"] != "TND" or kw["sparse_mode"] != 3:
        raise ProtocolError("the fake implements the TND layout with sparse_mode=3 only")
    if tuple(kw["atten_mask"].shape) != (2048, 2048):
        raise ProtocolError("sparse_mode=3 takes the compressed 2048 x 2048 mask")
    ends, kv = list(kw["actual_seq_lengths"]), list(kw["actual_seq_lengths_kv"])
    table = kw["block_table"]
    rows, heads, d = query.shape
    if len(ends) != len(kv) or ends[-1] != rows or table.shape[0] != len(ends):
        raise ProtocolError(f"lengths {ends} / {kv} and {table.shape[0]} table rows for {rows}")
    if heads != kw["num_heads"] or key.shape[1] != kw["block_size"]:
        raise ProtocolError("num_heads or block_size disagree with the tensors")
    kv_heads = kw["num_key_value_heads"]
    out = torch.zeros_like(query)
    start = 0
    for b, (end, length) in enumerate(zip(ends, kv, strict=True)):
        n = end - start
        if n and length:
            if length < n:
                raise ProtocolError(f"request {b}: {n} queries over {length} keys")
            blocks = table[b, : -(-length // kw["block_size"])].long()
            k = key[blocks].reshape(-1, kv_heads, d)[:length].transpose(0, 1)
            v = value[blocks].reshape(-1, kv_heads, d)[:length].transpose(0, 1)
            k = k.repeat_interleave(heads // kv_heads, dim=0)
            v = v.repeat_interleave(heads // kv_heads, dim=0)
            mask = torch.ones(n, length, dtype=torch.bool).tril(length - n)
            q = query[start:end].transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=kw["scale"])
            out[start:end] = o.transpose(0, 1)
        start = end
    return out


def _call_record(query, out, kw) -> dict[str, Any]:
    return {
        "ends": list(kw["actual_seq_lengths"]),
        "kv": list(kw["actual_seq_lengths_kv"]),
        "requests": len(kw["actual_seq_lengths"]),
        "query": query.data_ptr(),
        "out": None if out is None else out.data_ptr(),
    }


class _FusedAttention:
    def __init__(self, fake: FakeAscend) -> None:
        self.fake = fake

    def __call__(self, query, key, value, **kw):
        self.fake.note_attention(_call_record(query, None, kw), kw.pop("workspace", None))
        return _attention(self.fake, query, key, value, **kw), torch.empty(0)

    def out(self, query, key, value, *, workspace=None, out, **kw) -> None:
        self.fake.note_attention(_call_record(query, out[0], kw), workspace)
        out[0].copy_(_attention(self.fake, query, key, value, **kw))


def _npu_module(fake: FakeAscend) -> types.ModuleType:
    m = types.ModuleType("torch.npu")
    m.NPUGraph = lambda: FakeNpuGraph(fake)
    m.Stream = lambda: _new_stream(fake)
    m.Event = lambda: Event(fake)
    m.ExternalEvent = lambda: ExternalEvent(fake)
    m.current_stream = fake.current_stream
    m.stream = fake.stream
    m.graph = fake.graph
    m.synchronize = fake.synchronize
    m.graph_pool_handle = lambda: ("pool",)
    m.graph_task_group_begin = fake.group_begin
    m.graph_task_group_end = fake.group_end
    m.graph_task_update_begin = fake.update_begin
    m.graph_task_update_end = fake.update_end
    m.empty_cache = lambda: None
    m.memory_reserved = lambda: 0
    m.mem_get_info = lambda: (1 << 30, 1 << 31)
    m.is_available = lambda: True
    return m


def _new_stream(fake: FakeAscend) -> Stream:
    s = Stream(fake, f"side{len(fake.streams)}")
    fake.streams.append(s)
    return s


def _torch_npu_module(fake: FakeAscend) -> types.ModuleType:
    m = types.ModuleType("torch_npu")
    m.npu = fake.npu
    m.npu_fused_infer_attention_score = _FusedAttention(fake)

    def get_max_workspace(query, key, value, **kw) -> torch.Tensor:
        workspace = torch.empty(16, dtype=torch.uint8)
        fake.workspaces[id(workspace)] = max(kw["actual_seq_lengths_kv"], default=0)
        fake.log.append(("workspace", list(kw["actual_seq_lengths_kv"])))
        return workspace

    def reshape_and_cache(*, key, value, key_cache, value_cache, slot_indices) -> None:
        if slot_indices.dtype != torch.int32:
            raise ProtocolError("slot_indices are int32")
        kv_heads, d = key_cache.shape[-2:]
        key_cache.view(-1, kv_heads, d).index_copy_(0, slot_indices.long(), key)
        value_cache.view(-1, kv_heads, d).index_copy_(0, slot_indices.long(), value)

    m._npu_fused_infer_attention_score_get_max_workspace = get_max_workspace
    m._npu_reshape_and_cache = reshape_and_cache
    return m


@contextlib.contextmanager
def installed(monkeypatch) -> Iterator[FakeAscend]:
    """The fake as ``torch_npu`` and ``torch.npu``, with ``ostinato.platform.npu`` imported
    afresh against it."""
    import sys

    fake = FakeAscend()
    monkeypatch.setitem(sys.modules, "torch_npu", fake.torch_npu)
    monkeypatch.setattr(torch, "npu", fake.npu, raising=False)
    monkeypatch.delitem(sys.modules, "ostinato.platform.npu", raising=False)
    yield fake
