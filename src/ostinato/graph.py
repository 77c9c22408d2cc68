"""GraphWrapper: capture a callable as a graph on first use per batch, replay after."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from ostinato.batch import BatchDescriptor
from ostinato.capture_report import CaptureMeter
from ostinato.context import current_forward_context
from ostinato.errors import GraphCaptureError, InputAddressChangedError
from ostinato.guard import check_capture_allowed, locate_illegal_op
from ostinato.modes import GraphMode
from ostinato.param_updates import UpdatableTask, UpdateOrder, recording_tasks
from ostinato.platform import Graph, Platform, current_platform
from ostinato.platform.base import Held
from ostinato.pool import shared_pool
from ostinato.tensor_views import weak_ref_tensors

_ADDRESS_HINT = (
    "A graph reads its inputs from the addresses they had at capture. Copy new data into "
    "the captured buffer (buf[:n].copy_(x)) instead of passing a new tensor."
)


# Where a capture records (``recording_apart``): None, in the caller's context.
_apart: ContextVar[Held | None] = ContextVar("ostinato_recording_apart", default=None)


@contextlib.contextmanager
def recording_apart(apart: Held) -> Iterator[None]:
    """Inside, on this thread, a wrapper's capture records (and is measured) inside
    ``with apart():`` (a background capture's release of the step turn, where the
    platform records without running anything); a failed capture's diagnosis, which
    runs the callable eagerly, comes after it."""
    token = _apart.set(apart)
    try:
        yield
    finally:
        _apart.reset(token)


def recorded_apart() -> contextlib.AbstractContextManager[None]:
    """Where a capture on this thread records: inside the ``apart()`` that
    ``recording_apart`` set (the step turn let go), else in the caller's context. Only
    for a recording that runs nothing and touches nothing a step writes while it runs
    (``Platform.records_apart``)."""
    apart = _apart.get()
    return apart() if apart is not None else contextlib.nullcontext()


@dataclass
class GraphEntry:
    """One captured graph, the outputs it writes, (if checked) its input addresses, and
    the ops in it whose host parameters are updated before each replay (``tasks``).

    ``output`` holds non-owning views of the graph's outputs: valid after each replay of
    this graph until any graph sharing its pool is replayed.
    """

    descriptor: BatchDescriptor
    graph: Graph
    output: Any
    input_addresses: tuple[tuple[str, int], ...] | None = None
    tasks: tuple[UpdatableTask, ...] = ()


@dataclass(frozen=True)
class GraphOptions:
    """How a ``GraphWrapper`` captures.

    ``weak_ref_output``: return non-owning views even from the capturing call (safe only
    when nothing captured later reads this output, e.g. the last piece of a model).
    ``check_addresses``: record input addresses at capture and check them on every
    replay (``InputAddressChangedError`` names the input that moved).
    ``lazy_capture``: allow capture outside ``capture_phase()``.
    """

    weak_ref_output: bool = False
    check_addresses: bool = False
    lazy_capture: bool = False


class GraphWrapper:
    """Wraps a callable so that, in its runtime mode, it replays a graph per batch shape.

    Behaviour per call, from the forward context (``ostinato.forward_context``):
    if there is no context or its runtime mode is not this wrapper's ``mode``, the
    callable runs eagerly (this lets wrappers of different modes nest). Otherwise the
    graph for the context's batch descriptor is captured on first use (only inside the
    capture phase unless ``lazy_capture``) and replayed afterwards.

    Guarantees: a replay runs exactly the captured kernels on the captured addresses, so
    its results are bitwise those of an eager run on those addresses; a graph is never
    re-captured unasked (``GraphManager.recapture`` asks); a failed capture raises
    ``GraphCaptureError`` naming the op and source line that broke it, and leaves no
    entry behind. The wrapper does not copy inputs:
    the caller keeps them in persistent buffers.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        mode: GraphMode,
        *,
        options: GraphOptions | None = None,
        pool: Any = None,
        platform: Platform | None = None,
        meter: CaptureMeter | None = None,
        name: str | None = None,
    ) -> None:
        if mode not in (GraphMode.FULL, GraphMode.PIECEWISE):
            raise ValueError(f"mode: a GraphWrapper is FULL or PIECEWISE, got {mode.name}")
        self.runnable = runnable
        self.mode = mode
        self.options = options or GraphOptions()
        self.platform = platform or current_platform()
        self.pool = pool if pool is not None else shared_pool(self.platform)
        self.meter = meter
        self.name = name or getattr(runnable, "__qualname__", type(runnable).__name__)
        self.entries: dict[BatchDescriptor, GraphEntry] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = current_forward_context()
        if ctx is None or ctx.runtime_mode is not self.mode:
            return self.runnable(*args, **kwargs)
        descriptor = ctx.batch_descriptor
        entry = self.entries.get(descriptor)  # type: ignore[arg-type]
        if entry is None:
            return self._capture(descriptor, args, kwargs)
        if entry.input_addresses is not None:
            self._check_addresses(entry, args, kwargs)
        self._replay(entry, ctx.attn_metadata)
        return entry.output

    def replay(self, descriptor: BatchDescriptor, step: Any = None) -> Any:
        """Replays the graph captured for ``descriptor`` (no address check) and returns its
        outputs as non-owning views; ``step`` (the step's attention metadata) updates the
        graph's updatable tasks first. ``KeyError`` names a descriptor never captured;
        ``ValueError`` a graph with updatable tasks replayed without ``step``."""
        entry = self.entries.get(descriptor)
        if entry is None:
            raise KeyError(
                f"{self.name}: no {self.mode.name} graph was captured for {descriptor}; "
                "capture every size at start-up, before the first step"
            )
        self._replay(entry, step)
        return entry.output

    def replay_entry(self, entry: GraphEntry, step: Any = None) -> None:
        """Replays ``entry``, one of this wrapper's graphs whether it is in ``entries`` or
        set aside (``GraphManager.recapture`` times an old graph against its successor)."""
        self._replay(entry, step)

    def _replay(self, entry: GraphEntry, step: Any) -> None:
        platform = self.platform
        if entry.tasks and step is None:
            names = ", ".join(sorted({t.name for t in entry.tasks}))
            raise ValueError(
                f"{self.name} ({self.mode.name}, {entry.descriptor}): the graph holds "
                f"{len(entry.tasks)} ops with host parameters ({names}) that must be "
                "updated before each replay, and the replay was given no step metadata, "
                "so it would run them with the lengths of the capture. Pass the step's "
                "attention metadata: replay(descriptor, step), or the forward context's"
            )
        if entry.tasks and platform.update_order is UpdateOrder.REPLAY_THEN_UPDATE:
            # The fence, taken before the launch, marks the previous replay's end: the
            # updates wait for it, and this replay's tasks wait for the updates' events.
            fence = platform.replay_fence()
            entry.graph.replay()
            platform.update_tasks(entry.tasks, step, fence)
            return
        # Ascend (synchronize-then-update) needs the previous replay finished before its
        # tasks are rewritten; CUDA needs nothing.
        if platform.sync_before_replay:
            platform.synchronize()
        if entry.tasks:
            platform.update_tasks(entry.tasks, step)
        entry.graph.replay()

    def _capture(
        self, descriptor: BatchDescriptor | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        entry, output = self._new_entry(descriptor, args, kwargs)
        self.entries[entry.descriptor] = entry
        # The capturing call returns owning tensors so the pool keeps them alive while
        # the rest of this step (maybe further captures) still reads them.
        return weak_ref_tensors(output) if self.options.weak_ref_output else output

    def record_anew(
        self, descriptor: BatchDescriptor, args: tuple[Any, ...], diagnose: bool = True
    ) -> GraphEntry:
        """``descriptor``'s graph captured again (in the forward context the caller
        opened) and its entry returned, not installed: the one in ``entries`` stays and
        may replay meanwhile; the caller swaps them (``GraphManager.recapture``). Without
        ``diagnose`` a failed capture is not run eagerly to find the op that broke it (it
        may run beside steps whose inputs that run would read)."""
        return self._new_entry(descriptor, args, {}, diagnose)[0]

    def _new_entry(
        self,
        descriptor: BatchDescriptor | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        diagnose: bool = True,
    ) -> tuple[GraphEntry, Any]:
        """A new graph of the runnable on ``args`` for ``descriptor``: its entry, and the
        capturing call's owning outputs."""
        what = f"{self.name} ({self.mode.name}, {descriptor})"
        if descriptor is None:
            raise ValueError(
                f"{what}: the forward context has runtime mode {self.mode.name} but no batch "
                "descriptor; pass the one Dispatcher.dispatch returned"
            )
        check_capture_allowed(what, self.options.lazy_capture)
        graph = self.platform.new_graph()
        addresses = _input_addresses(args, kwargs) if self.options.check_addresses else None
        beside = recorded_apart()
        meter, nothing = self.meter, contextlib.nullcontext()
        measured = nothing if meter is None else meter.measure(descriptor, self.mode)
        try:
            with beside, measured:
                output, tasks = self._record(graph, args, kwargs)
        except Exception as exc:
            if not diagnose:
                raise GraphCaptureError(
                    f"capturing {what} failed beside running steps (not run again eagerly to "
                    f"find the op: that run would read their inputs). Underlying error: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            raise self._capture_error(what, exc, args, kwargs) from exc
        entry = GraphEntry(descriptor, graph, weak_ref_tensors(output), addresses, tasks)
        return entry, output

    def _record(
        self, graph: Graph, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, tuple[UpdatableTask, ...]]:
        with recording_tasks(self.platform) as registry, self.platform.capture(graph, self.pool):
            output = self.runnable(*args, **kwargs)
        return output, tuple(registry.tasks)

    def _capture_error(
        self, what: str, exc: Exception, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> GraphCaptureError:
        underlying = f"Underlying error: {type(exc).__name__}: {exc}"
        if isinstance(exc, torch.OutOfMemoryError):
            free = self.platform.device_memory()
            room = f" ({free[0] / 2**20:.0f} MiB free)" if free else ""
            return GraphCaptureError(
                f"capturing {what} ran out of device memory{room}: the graph pool needs "
                "more than is left after the weights and caches. Capture fewer or smaller "
                "sizes (max_capture_size, capture_sizes), leave more room (a lower "
                "gpu_memory_utilization or a smaller KV cache), or run in NONE mode.\n" + underlying
            )
        culprit = locate_illegal_op(self.platform, self.runnable, args, kwargs)
        if culprit is None:
            return GraphCaptureError(
                f"capturing {what} failed, and running it eagerly with host syncs forbidden "
                "raised nothing, so the cause is not a host sync; see the underlying error "
                "and the chained exception.\n" + underlying
            )
        return GraphCaptureError(
            f"capturing {what} failed at {culprit.where}: `{culprit.source}` waits for the "
            f"device ({culprit.error}), which a graph cannot hold because it replays device "
            "work without the host. Move it out of the captured code (ops like .item(), "
            ".tolist(), .cpu(), print(tensor), nonzero, boolean masks, data-dependent "
            "shapes), or run this step in NONE mode.\n" + underlying
        )

    def _check_addresses(
        self, entry: GraphEntry, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        now = _input_addresses(args, kwargs)
        if now == entry.input_addresses:
            return
        before = dict(entry.input_addresses or ())
        after = dict(now)
        for name in sorted(before.keys() | after.keys()):
            if before.get(name) != after.get(name):
                was = before.get(name)
                new = after.get(name)
                raise InputAddressChangedError(
                    f"{self.name} ({self.mode.name}, {entry.descriptor}): input {name} "
                    f"was at {_hex(was)} at capture and is at {_hex(new)} now. " + _ADDRESS_HINT
                )

    def reset(self) -> None:
        """Drops every captured graph. Only safe when no graph of the pool replays after."""
        for entry in self.entries.values():
            entry.graph.reset()
        self.entries.clear()


def _input_addresses(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    found = [(f"argument #{i}", a.data_ptr()) for i, a in enumerate(args) if _is_tensor(a)]
    found += [(f"argument {k!r}", v.data_ptr()) for k, v in kwargs.items() if _is_tensor(v)]
    return tuple(found)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _hex(address: int | None) -> str:
    return "(absent)" if address is None else hex(address)
