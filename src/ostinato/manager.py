"""GraphManager: captures every size of a model runner's step at start-up, replays per step."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from tqdm.auto import tqdm

from ostinato.background import BackgroundCapture, InUnits, Turn
from ostinato.batch import BatchDescriptor, CaptureItem
from ostinato.capture_report import CaptureMeter, CaptureReport
from ostinato.context import forward_context
from ostinato.dispatcher import Dispatch, Dispatcher
from ostinato.errors import GraphCaptureError
from ostinato.graph import GraphEntry, GraphWrapper, recording_apart
from ostinato.graph_outputs import Outputs, PoolOutputs, StaticOutputs, as_tuple, first_rows
from ostinato.guard import capture_phase
from ostinato.mathutil import is_int
from ostinato.modes import GraphMode
from ostinato.platform import Graph, Platform, current_platform
from ostinato.platform.base import Held
from ostinato.pool import shared_pool
from ostinato.recapture import KeepNew, Recapture
from ostinato.replay_check import GraphDemotedWarning, Mismatch, ReplayCheck, first_mismatch
from ostinato.replay_stats import EagerReason, ReplayStats, StatsSnapshot

_NO_TURN = contextlib.nullcontext()
StepFn = Callable[[BatchDescriptor], Outputs]
PrepareFn = Callable[[BatchDescriptor], Any]
PerturbFn = Callable[[BatchDescriptor, int], None]


def _check_run_arguments(dispatch: object, num_tokens: object) -> None:
    """``TypeError`` naming a ``run`` argument of the wrong type (a subclass of
    ``Dispatch`` and any integer type pass)."""
    if not isinstance(dispatch, Dispatch):
        raise TypeError(
            f"run: expected the Dispatch that dispatch(num_tokens) returns, got "
            f"{type(dispatch).__name__}; call graphs.dispatch(num_tokens) and pass its result"
        )
    if not is_int(num_tokens):
        raise TypeError(f"num_tokens: expected an int, got {num_tokens!r}")


class GraphManager:
    """Runs a model runner's step as FULL graphs, PIECEWISE graphs or eagerly, per batch.

    ``step(descriptor)`` runs the model on the first ``descriptor.num_tokens`` rows of the
    runner's persistent input buffers and returns a tensor (the hidden states) or a tuple
    of tensors (hidden states, then auxiliary outputs), each with tokens on dim 0.
    ``prepare(descriptor)``, if given, writes dummy inputs for a capture of that shape
    into the buffers and returns the attention metadata to put in the forward context.
    ``warm_step(descriptor)``, if given, does ``step``'s work on inputs of its own, which
    no step reads or writes (padding rows in buffers apart, in a forward context it
    opens): a background capture on a platform that records apart
    (``Platform.records_apart``) then warms a FULL graph up with it beside the steps, and
    holds their turn only for ``prepare``.

    Guarantees: ``capture()`` captures every FULL descriptor of the dispatcher (mixed
    batches first, then uniform decode, each largest first) and runs every PIECEWISE
    descriptor once so its pieces capture, all into one shared pool, each after
    ``num_warmups`` eager runs, with garbage collection paused; graphs stay alive until
    ``release()``. ``check`` (``ostinato.replay_check``; ``verify_graphs=True`` is
    ``ReplayCheck("capture")``) compares FULL replays with eager runs at capture (with
    ``perturb_padding(descriptor, real_rows)``, which gives the rows from ``real_rows`` on
    other contents, also checking that padding cannot reach real rows) or one replay in
    ``every`` while serving; a bucket that differs is demoted to eager with a
    ``GraphDemotedWarning``, and the step that found it returns the eager outputs.
    A capture that fails or runs out of memory releases every graph
    of this manager before ``GraphCaptureError`` propagates. ``run`` returns views of
    the FULL graphs' outputs sliced to the real token count, overwritten by the next FULL
    replay: of static output buffers (allocated once, outside the pool), or, with
    ``outputs=PoolOutputs()``, of each graph's own outputs in the pool, which any
    capture into the pool may also overwrite. Replaying a FULL descriptor that
    was never captured raises.

    ``capture_in_background()`` instead returns at once and captures on a thread; until a
    size is ready (``ready``), ``run`` runs it eagerly. Callers that write a step's
    inputs into persistent buffers do it inside ``with manager.stepping():``, together
    with the ``run`` and anything that reads its outputs.
    """

    def __init__(
        self,
        step: StepFn,
        dispatcher: Dispatcher,
        *,
        prepare: PrepareFn | None = None,
        num_warmups: int = 1,
        verify_graphs: bool = False,
        progress: bool = True,
        platform: Platform | None = None,
        pool: Any = None,
        check: ReplayCheck | None = None,
        perturb_padding: PerturbFn | None = None,
        outputs: StaticOutputs | PoolOutputs | None = None,
        warm_step: StepFn | None = None,
    ) -> None:
        self.step = step
        self.warm_step = warm_step
        self.dispatcher = dispatcher
        self.prepare = prepare
        self.num_warmups = num_warmups
        self.check = ReplayCheck.chosen(verify_graphs, check)
        self.perturb_padding = perturb_padding
        self.demoted: dict[BatchDescriptor, str] = {}  # bucket -> why (written once)
        self._full_replays = 0  # the sampling clock
        self.progress = progress
        self.platform = platform or current_platform()
        self.pool = pool if pool is not None else shared_pool(self.platform)
        self.report = CaptureReport()
        rows = max((k.num_tokens for k in dispatcher.keys(GraphMode.FULL)), default=0)
        if isinstance(outputs, StaticOutputs) and outputs.rows < rows:
            raise ValueError(
                f"outputs: shared static outputs of {outputs.rows} rows, fewer than the "
                f"largest FULL size {rows}"
            )
        self.outputs = outputs if outputs is not None else StaticOutputs(rows)
        self._full = GraphWrapper(
            self._step_full,
            GraphMode.FULL,
            pool=self.pool,
            platform=self.platform,
            meter=CaptureMeter(self.report, self.platform, self.pool),
            name="GraphManager.step",
        )
        self._meter = self._full.meter
        self._pieces_ready: set[BatchDescriptor] = set()  # PIECEWISE sizes captured
        # Held by a step (inputs written, work queued, outputs read) and by each item a
        # background capture records: the two never interleave.
        self._turn = Turn()
        self.background: BackgroundCapture | None = None
        self._later: list[CaptureItem] | None = None  # capture_on_steps' items left
        self._stats = ReplayStats(dispatcher.max_size)

    def capture_plan(self) -> list[CaptureItem]:
        """What ``capture()`` will capture, in order."""
        full = self.dispatcher.keys(GraphMode.FULL)
        mixed = [CaptureItem(d, GraphMode.FULL) for d in full if not d.uniform_decode]
        uniform = [CaptureItem(d, GraphMode.FULL) for d in full if d.uniform_decode]
        piecewise = [
            CaptureItem(d, GraphMode.PIECEWISE) for d in self.dispatcher.keys(GraphMode.PIECEWISE)
        ]
        return mixed + piecewise + uniform

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Captures everything in ``capture_plan()``; returns (and keeps) the report."""
        plan = self.capture_plan()
        with capture_phase():
            for item in tqdm(
                plan, desc="ostinato: capturing graphs", disable=not self.progress or not plan
            ):
                self.capture_item(item)
        return self.report

    def capture_in_background(
        self,
        prologue: Callable[[], None] | None = None,
        epilogue: InUnits | None = None,
        afterwards: InUnits | None = None,
        settle: Callable[[], None] | None = None,
    ) -> BackgroundCapture:
        """Starts capturing ``capture_plan()`` on a thread and returns at once (see
        ``ostinato.background``); ``prologue`` runs on the thread first, ``epilogue``
        once every graph is captured, and ``afterwards`` after it, each taking the step
        turn for each unit of its work (the ``unit`` it is called with); ``settle`` last,
        without the turn, before the capture is ``done`` (not after a stop). The report
        fills as graphs are captured; a failure releases every graph and leaves the
        steps eager. The capture check is refused: its replays would overwrite the
        static outputs of a step in flight (sampling while serving is allowed)."""
        if self.background is not None:
            raise RuntimeError("capture_in_background: this manager already captures")
        if self.check.at_capture:
            raise ValueError(
                "verify_graphs: each check replays a graph, which would overwrite the "
                "outputs of a step running meanwhile; verify with a blocking capture(), "
                "or sample replays while serving (verify='sample')"
            )
        beside = self.platform.records_apart and self.warm_step is not None
        # Kept before its thread starts: a step asking for the turn must find it.
        self.background = BackgroundCapture(
            self.capture_plan(), self.capture_item, self._release_graphs, self._turn,
            prologue, epilogue, afterwards, beside, settle,
        )  # fmt: skip
        return self.background.start()

    def capture_on_steps(self) -> None:
        """Captures nothing now: ``capture_next``, called by the caller between steps,
        records ``capture_plan()`` one item at a time, on the caller's thread; until its
        item is captured a step runs eagerly (``NOT_CAPTURED_YET``). For callers whose
        own code between steps uses the device (random numbers, synchronizations), which
        a capture on another thread would break."""
        if self.background is not None or self._later is not None:
            raise RuntimeError("capture_on_steps: this manager already captures")
        self._later = self.capture_plan()

    def capture_next(self, want: Dispatch | None = None) -> bool:
        """After ``capture_on_steps``: captures the item ``want`` (a step's dispatch)
        replays if it is still to be captured, else the next in plan order; returns
        whether one was captured. A failure releases every graph and drops the rest of the
        plan (the steps then run eagerly) and raises ``GraphCaptureError``, as ``capture``
        does."""
        if not self._later:
            return False
        wanted = CaptureItem(want.descriptor, want.mode) if want is not None else None
        item = next((i for i in self._later if i == wanted), self._later[0])
        self._later.remove(item)
        try:
            with torch.inference_mode(), capture_phase(collect=False):
                self.capture_item(item)
        except BaseException:
            self._later = []
            raise
        return True

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        """The step's turn: hold it (``with manager.stepping():``) from writing a step's
        inputs until its outputs are read or queued for reading, so that a background
        capture never writes dummy inputs in between. Re-entrant; a no-op without a
        background capture, and once it is done (its thread touches nothing after: the
        steps then pay no lock, as after a blocking capture)."""
        background = self.background
        return self._turn if background is not None and not background.done else _NO_TURN

    def ready(self, dispatch: Dispatch) -> bool:
        """Whether ``run(dispatch, ...)`` runs as dispatched (NONE; a captured FULL graph;
        PIECEWISE pieces captured at that size) rather than eagerly."""
        mode, d = dispatch.mode, dispatch.descriptor
        if mode is GraphMode.FULL:
            return d in self._full.entries and d not in self.demoted
        return mode is GraphMode.NONE or d in self._pieces_ready

    def capture_item(self, item: CaptureItem, apart: Held | None = None) -> None:
        """Captures one item of ``capture_plan()`` (a FULL graph, or a PIECEWISE size's
        pieces); a failure releases every graph of this manager and raises
        ``GraphCaptureError``, as ``capture()`` does. ``apart`` (a background capture's
        release of the step turn): where the platform records without running anything,
        a FULL graph records inside ``with apart():``, its dummy inputs and warm-ups
        before it."""
        try:
            self._capture_one(item, apart if self.platform.records_apart else None)
        except torch.OutOfMemoryError as exc:
            # Out of memory in a warm-up run, outside the graph wrapper.
            self.release()
            raise GraphCaptureError(
                f"capture of {item.descriptor} ({item.mode.name}) ran out of device "
                "memory in its eager warm-up. Capture fewer or smaller sizes "
                "(max_capture_size), leave more room (a lower gpu_memory_utilization "
                f"or a smaller KV cache), or run in NONE mode.\nUnderlying error: {exc}"
            ) from exc
        except GraphCaptureError:
            self.release()  # all or nothing: no half-captured ladder survives
            raise
        if item.mode is GraphMode.PIECEWISE:
            self._pieces_ready.add(item.descriptor)

    def _capture_one(self, item: CaptureItem, apart: Held | None = None) -> None:
        d = item.descriptor
        full = item.mode is GraphMode.FULL
        beside = apart if full else None  # (``capture_item``: the steps may run meanwhile)
        # The first FULL capture needs one eager output to size the static buffers.
        warmups = max(self.num_warmups, 1 if full and not self.outputs.allocated else 0)
        if beside is not None and self.warm_step is not None:
            with beside():  # (on inputs of its own)
                self._warm_up(d, full, warmups, functools.partial(self.warm_step, d))
            warmups = 0
        attn_metadata = self.prepare(d) if self.prepare is not None else None
        if warmups:
            self._warm_up(d, full, warmups, functools.partial(self._eager, d, attn_metadata))
            if beside is not None:
                # Steps write the inputs once the turn is let go: the warm-up reads them first.
                self.platform.synchronize()
        # A FULL capture offers the step the static buffers' rows to write into.
        outputs = self.outputs.into(d.num_tokens) if full else None
        with forward_context(item.mode, d, attn_metadata, outputs):
            if full:
                with recording_apart(beside) if beside is not None else contextlib.nullcontext():
                    self._full(d)
            else:
                with self._meter.measure(d, item.mode):
                    self.step(d)
        if self.check.at_capture and full:
            self._verify(d, attn_metadata)

    def _warm_up(
        self, d: BatchDescriptor, full: bool, times: int, run: Callable[[], Outputs]
    ) -> None:
        """``times`` runs of ``run`` (the step's work at ``d``, eagerly) before a capture;
        the first of a FULL graph sizes the static outputs."""
        for _ in range(times):
            out = run()
            _check_rows(out, d)
            if full and not self.outputs.allocated:
                self.outputs.allocate(out)
            del out  # (before the next run: the two need not coexist)

    def _eager(self, d: BatchDescriptor, attn_metadata: Any) -> Outputs:
        with forward_context(GraphMode.NONE, d, attn_metadata):
            return self.step(d)

    def _verify(self, d: BatchDescriptor, attn_metadata: Any, entry: Any = None) -> None:
        """The capture check: replay against eager bitwise, then (with a padding hook)
        the real rows of two replays whose padding rows differ. ``entry``: the graph to
        check, where not ``d``'s in ``entries`` (one captured again)."""
        n = d.num_tokens
        replayed = self._replay_copy(d, attn_metadata, entry)
        with forward_context(GraphMode.NONE, d, attn_metadata):
            eager = as_tuple(self.step(d))
        found = first_mismatch(replayed, eager, n, exact=True)
        if found is not None:
            self._demote(d, found, "differs from an eager run of the same step")
            return
        if self.perturb_padding is None or n < 2:
            return
        real = n // 2
        self.perturb_padding(d, real)
        again = self._replay_copy(d, attn_metadata, entry)
        found = first_mismatch(again, replayed, real, exact=True)
        if found is not None:
            self._demote(d, found, f"changes its first {real} rows when the others change")

    def _replay_copy(
        self, d: BatchDescriptor, attn_metadata: Any, entry: Any = None
    ) -> tuple[torch.Tensor, ...]:
        if entry is None:
            replayed = self._full.replay(d, attn_metadata)
        else:
            self._full.replay_entry(entry, attn_metadata)
            replayed = entry.output
        return tuple(t.clone() for t in as_tuple(self.outputs.read(replayed, d.num_tokens)))

    def _demote(self, d: BatchDescriptor, found: Mismatch, what: str) -> None:
        why = found.describe(d, what)
        self.demoted[d] = why
        self._stats.demoted(d)
        warnings.warn(
            f"{why}. Its steps now run eagerly. The step depends on something the graph "
            "froze at capture (a Python number, a tensor allocated anew per call, host "
            "data) or mixes rows (padding reaching real rows); keep every input in a "
            "persistent device buffer and keep rows independent.",
            GraphDemotedWarning,
            stacklevel=3,
        )

    def _sample(self, d: BatchDescriptor, out: Outputs, num_tokens: int, meta: Any) -> Outputs:
        """A sampled replay's outputs (``out``) checked against an eager run of the same
        step (same persistent inputs); on a mismatch the bucket is demoted, eager's returned."""
        with forward_context(GraphMode.NONE, d, meta):
            eager = self.step(d)
        self._stats.checked()
        found = first_mismatch(as_tuple(out), as_tuple(eager), num_tokens, exact=False)
        if found is None:
            return out
        self._demote(d, found, "differs from an eager run of a sampled step")
        return _rows(eager, d, num_tokens)

    def resize(self, sizes: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Between steps, moves a FULL ladder to ``sizes``: captures the graphs it lacks
        (into the shared pool) and destroys those it drops, and dispatches over the new
        ladder from the next step on. Returns the sizes added and dropped.

        Only a FULL-mode manager whose capture is done (blocking, or a background
        capture that ended without error; no uniform decode graphs, no captures left
        for the steps), and the largest size stays: the static outputs
        are sized for it. Never call it inside ``stepping()`` or from another thread
        while a step runs. The capture report keeps every capture, dropped ones too: its
        total is what the pool grew by (a dropped graph's memory stays in the pool, for
        the next captures)."""
        mode, background = self.dispatcher.mode, self.background
        capturing = background is not None and not background.finished
        if mode is not GraphMode.FULL or capturing or self._later is not None:
            raise ValueError(
                f"resize: only a FULL-mode manager whose capture is done can change its "
                f"ladder between steps (this one is {mode.name}"
                f"{', capturing in the background' if capturing else ''})"
            )
        dispatcher = self.dispatcher.with_sizes(sizes)
        if dispatcher.max_size != self.dispatcher.max_size:
            raise ValueError(
                f"resize: the largest size must stay {self.dispatcher.max_size} (the static "
                f"outputs are sized for it), got {dispatcher.max_size}"
            )
        old = {d.num_tokens: d for d in self.dispatcher.keys(GraphMode.FULL)}
        new = {d.num_tokens: d for d in dispatcher.keys(GraphMode.FULL)}
        added = tuple(n for n in sorted(new, reverse=True) if n not in old)
        dropped = tuple(n for n in sorted(old) if n not in new)
        # New graphs first (a failure leaves the old ladder whole), then the old go.
        with capture_phase(), torch.inference_mode():
            try:
                for n in added:  # largest first, as at start-up
                    self._capture_one(CaptureItem(new[n], GraphMode.FULL))
            except Exception:
                self._drop(new[n] for n in added)
                raise
        self.platform.synchronize_outside_capture()  # no replay of a dropped graph is queued
        self._drop(old[n] for n in dropped)
        self.dispatcher = dispatcher
        return added, dropped

    def recapture(
        self, descriptor: BatchDescriptor, keep_new: KeepNew, turn: Held | None = None
    ) -> bool:
        """Captures ``descriptor``'s FULL graph again, for a step function that now
        launches other kernels (the engine's measured kernel plans), into the shared pool
        and onto the same static outputs, so whatever reads those (sampling graphs) reads
        the new graph's as it read the old's. ``keep_new(old, new, held)`` is given a
        replay of each on dummy inputs ``prepare`` wrote, and ``held`` to hold around each
        round of replays; it says which graph stays, and the other is destroyed. Returns
        whether the new one stayed. A failed capture keeps the old graph and raises
        ``GraphCaptureError``.

        Between steps only. Without ``turn`` the caller holds the step turn
        (``stepping()``) or no step runs. With ``turn`` (a background caller's hold of
        it, not held on entry) the capture holds one turn (only for its dummy inputs
        where the platform records apart and a ``warm_step`` warms up beside the steps),
        each round of the choice another (the device drained and the dummy inputs
        written again in it: steps ran between, replaying the old graph), and the swap a
        last one: a step waits for one of those, not for the whole."""
        redo = Recapture(self._full, self._capture_anew, self.prepare, self.platform)
        return redo(descriptor, keep_new, turn)

    def _capture_anew(self, d: BatchDescriptor, turn: Held | None) -> GraphEntry:
        """``d``'s FULL graph captured again, its entry returned (``entries`` untouched:
        the steps replay the old one meanwhile): in one hold of ``turn`` where given, or,
        where the platform records apart and a ``warm_step`` is given, warmed up and
        recorded beside the steps, the hold only writing the dummy inputs."""
        beside = turn is not None and self.platform.records_apart and self.warm_step is not None
        if beside:
            self._warm_up(d, True, self.num_warmups, functools.partial(self.warm_step, d))
        outputs = self.outputs.into(d.num_tokens)
        with turn() if turn is not None else _NO_TURN:
            # No drain: the dummy inputs are device work queued behind the steps' work that
            # reads them (one stream); a drain held the steps for their queued work too.
            meta = self.prepare(d) if self.prepare is not None else None
            if not beside:
                self._warm_up(d, True, self.num_warmups, functools.partial(self._eager, d, meta))
                with forward_context(GraphMode.FULL, d, meta, outputs):
                    entry = self._full.record_anew(d, (d,))
                if self.check.at_capture:
                    self._verify(d, meta, entry)
                return entry
        with forward_context(GraphMode.FULL, d, meta, outputs):
            entry = self._full.record_anew(d, (d,), diagnose=False)
        if self.check.at_capture:  # (a blocking start's turn: a background one refuses it)
            with turn():
                self._verify(d, self.prepare(d) if self.prepare is not None else None, entry)
        return entry

    def _drop(self, descriptors: Iterable[BatchDescriptor]) -> None:
        for d in descriptors:
            entry = self._full.entries.pop(d, None)
            if entry is not None:
                entry.graph.reset()
            self.demoted.pop(d, None)

    def _step_full(self, d: BatchDescriptor) -> Outputs | None:
        """A FULL graph's step: outputs written to static buffers, or returned (``PoolOutputs``)."""
        out = self.step(d)
        _check_rows(out, d)
        return self.outputs.keep(out, d.num_tokens)

    def run(
        self, dispatch: Dispatch, num_tokens: int, attn_metadata: Any = None, record: bool = True
    ) -> Outputs:
        """Runs one step as ``dispatch`` says; outputs are sliced to ``num_tokens`` rows;
        ``record=False``: not counted in ``stats()`` (a measurement's runs).

        Raises ``ValueError`` if ``num_tokens`` is negative or larger than the dispatch's
        padded size: those rows were never computed; ``KeyError`` for a FULL dispatch
        whose graph was never captured.
        """
        # The type checks run only where a cheap test fails: this is the replay path.
        if type(dispatch) is not Dispatch or (
            type(num_tokens) is not int and not is_int(num_tokens)
        ):
            _check_run_arguments(dispatch, num_tokens)
        d = dispatch.descriptor
        if not 0 <= num_tokens <= d.num_tokens:
            raise ValueError(
                f"num_tokens: {num_tokens} rows asked of a step dispatched for "
                f"{d.num_tokens} padded tokens; pass the count given to dispatch() "
                "(0 <= num_tokens <= padded_tokens)"
            )
        mode = dispatch.mode
        reason = None
        if mode is GraphMode.FULL and d in self.demoted:
            mode, reason = GraphMode.NONE, EagerReason.DEMOTED
        elif self._later is not None and not self.ready(dispatch):
            mode = GraphMode.NONE  # (captured by a later capture_next, or failed)
        elif self.background is not None and not self.ready(dispatch):
            with self._turn:  # (the caller holds it too: re-entrant)
                if not self.ready(dispatch):
                    self.background.want(d)
                    mode = GraphMode.NONE
        if record:
            self._stats.record(dispatch, num_tokens, mode, reason)
        if mode is GraphMode.FULL:
            out = self.outputs.read(self._full.replay(d, attn_metadata), num_tokens)
            if self.check.sampling:
                self._full_replays += 1
                if self._full_replays % self.check.every == 0:
                    return self._sample(d, out, num_tokens, attn_metadata)
            return out
        with forward_context(mode, d, attn_metadata):
            out = self.step(d)
        return _rows(out, d, num_tokens)

    def stats(self) -> StatsSnapshot:
        """Live statistics per bucket since construction: replays, real and padded rows,
        capture seconds and pool bytes of every capturable size (largest first within a
        mode), and the eager steps by reason. Safe to call from another thread."""
        keys = [
            Dispatch(mode, d)
            for mode in (GraphMode.FULL, GraphMode.PIECEWISE)
            for d in self.dispatcher.keys(mode)
        ]
        return self._stats.snapshot(self.report, keys)

    def graph(self, descriptor: BatchDescriptor) -> Graph:
        """The FULL graph captured for ``descriptor``; raises ``KeyError`` if there is none."""
        return self._full.entries[descriptor].graph

    @property
    def num_graphs(self) -> int:
        """FULL graphs held by this manager (piecewise graphs live in their wrappers)."""
        return len(self._full.entries)

    def release(self) -> None:
        """Stops a background capture, then destroys every FULL graph at once; the
        manager must not replay afterwards. Safe to call more than once."""
        if self.background is not None:
            self.background.stop()
        if self._later is not None:
            self._later = []
        self._release_graphs()

    def _release_graphs(self) -> None:
        self.platform.synchronize_outside_capture()
        self._full.reset()
        self._pieces_ready.clear()
        self.outputs.forget()


def _rows(out: Outputs, d: BatchDescriptor, num_tokens: int) -> Outputs:
    """The first ``num_tokens`` rows of a step's outputs (themselves when all)."""
    return out if d.num_tokens == num_tokens else first_rows(out, num_tokens)


def _check_rows(out: Outputs, d: BatchDescriptor) -> None:
    for i, t in enumerate(as_tuple(out)):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != d.num_tokens:
            raise ValueError(
                f"step output #{i} for {d} must be a tensor with {d.num_tokens} rows "
                f"(tokens on dim 0), got {getattr(t, 'shape', type(t).__name__)}"
            )
