"""GraphManager: captures every size of a model runner's step at start-up, replays per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ostinato.batch import BatchDescriptor
from ostinato.context import forward_context
from ostinato.dispatcher import Dispatch, Dispatcher
from ostinato.errors import GraphCaptureError
from ostinato.graph import GraphWrapper
from ostinato.guard import capture_phase
from ostinato.modes import GraphMode
from ostinato.platform import Graph, Platform, current_platform
from ostinato.pool import CaptureMeter, CaptureReport, shared_pool

Outputs = torch.Tensor | tuple[torch.Tensor, ...]
StepFn = Callable[[BatchDescriptor], Outputs]
PrepareFn = Callable[[BatchDescriptor], Any]


@dataclass(frozen=True)
class CaptureItem:
    """One unit of start-up capture: a descriptor and the runtime mode to capture it in."""

    descriptor: BatchDescriptor
    mode: GraphMode


class GraphManager:
    """Runs a model runner's step as FULL graphs, PIECEWISE graphs or eagerly, per batch.

    ``step(descriptor)`` runs the model on the first ``descriptor.num_tokens`` rows of the
    runner's persistent input buffers and returns a tensor (the hidden states) or a tuple
    of tensors (hidden states, then auxiliary outputs), each with tokens on dim 0.
    ``prepare(descriptor)``, if given, writes dummy inputs for a capture of that shape
    into the buffers and returns the attention metadata to put in the forward context.

    Guarantees: ``capture()`` captures every FULL descriptor of the dispatcher (mixed
    batches first, then uniform decode, each largest first) and runs every PIECEWISE
    descriptor once so its pieces capture, all into one shared pool, each after
    ``num_warmups`` eager runs, with garbage collection paused; graphs stay alive until
    ``release()``. With ``debug``, each FULL graph is replayed once after capture and
    compared bitwise with an eager run of the same step; a difference raises
    ``GraphCaptureError``. ``run`` returns views of static output buffers (allocated once,
    outside the pool) sliced to the real token count; they are overwritten by the next
    FULL replay. Replaying a FULL descriptor that was never captured raises.
    """

    def __init__(
        self,
        step: StepFn,
        dispatcher: Dispatcher,
        *,
        prepare: PrepareFn | None = None,
        num_warmups: int = 1,
        debug: bool = False,
        progress: bool = True,
        platform: Platform | None = None,
        pool: Any = None,
    ) -> None:
        self.step = step
        self.dispatcher = dispatcher
        self.prepare = prepare
        self.num_warmups = num_warmups
        self.debug = debug
        self.progress = progress
        self.platform = platform or current_platform()
        self.pool = pool if pool is not None else shared_pool(self.platform)
        self.report = CaptureReport()
        self._meter = CaptureMeter(self.report, self.platform)
        self._static: tuple[torch.Tensor, ...] | None = None
        self._returns_tuple = False
        # _outputs[n]: the static outputs sliced to n rows, built once so replay slices nothing.
        self._outputs: list[Outputs] = []
        self._full = GraphWrapper(
            self._step_into_static,
            GraphMode.FULL,
            pool=self.pool,
            platform=self.platform,
            meter=self._meter,
            name="GraphManager.step",
        )

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
                try:
                    self._capture_one(item)
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
        if self._static is not None:
            rows = self._static[0].shape[0]
            self._outputs = [self._slice_static(n) for n in range(rows + 1)]
        return self.report

    def _slice_static(self, n: int) -> Outputs:
        assert self._static is not None
        if self._returns_tuple:
            return tuple(t[:n] for t in self._static)
        return self._static[0][:n]

    def _capture_one(self, item: CaptureItem) -> None:
        d = item.descriptor
        attn_metadata = self.prepare(d) if self.prepare is not None else None
        for _ in range(self.num_warmups):
            with forward_context(GraphMode.NONE, d, attn_metadata):
                out = self.step(d)
            self._ensure_static(out, d)
        if self._static is None:  # num_warmups == 0: size the buffers from a dry run
            with forward_context(GraphMode.NONE, d, attn_metadata):
                self._ensure_static(self.step(d), d)
        with forward_context(item.mode, d, attn_metadata):
            if item.mode is GraphMode.FULL:
                self._full(d)
            else:
                with self._meter.measure(d, item.mode):
                    self.step(d)
        if self.debug and item.mode is GraphMode.FULL:
            self._verify(d, attn_metadata)

    def _verify(self, d: BatchDescriptor, attn_metadata: Any) -> None:
        assert self._static is not None
        self.graph(d).replay()
        replayed = [t[: d.num_tokens].clone() for t in self._static]
        with forward_context(GraphMode.NONE, d, attn_metadata):
            eager = _as_tuple(self.step(d))
        for i, (r, e) in enumerate(zip(replayed, eager, strict=True)):
            if not torch.equal(r, e):
                diff = (r.double() - e.double()).abs().max().item()
                raise GraphCaptureError(
                    f"debug check: the FULL graph for {d} differs from an eager run of the same "
                    f"step in output #{i} (max |diff| = {diff:.3g}). The step depends on "
                    "something the graph froze at capture: a Python number, a tensor "
                    "allocated anew per call, or host data. Keep every input in a persistent "
                    "device buffer that the step reads."
                )

    def _ensure_static(self, out: Outputs, d: BatchDescriptor) -> None:
        outs = _as_tuple(out)
        for i, t in enumerate(outs):
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != d.num_tokens:
                raise ValueError(
                    f"step output #{i} for {d} must be a tensor with {d.num_tokens} rows "
                    f"(tokens on dim 0), got {getattr(t, 'shape', type(t).__name__)}"
                )
        if self._static is None:
            self._returns_tuple = isinstance(out, (tuple, list))
            rows = max((k.num_tokens for k in self.dispatcher.keys(GraphMode.FULL)), default=0)
            self._static = tuple(
                torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in outs
            )

    def _step_into_static(self, d: BatchDescriptor) -> None:
        assert self._static is not None
        outs = _as_tuple(self.step(d))
        for buf, t in zip(self._static, outs, strict=True):
            buf[: d.num_tokens].copy_(t)

    def plan(
        self, num_tokens: int, uniform_decode: bool = False, has_lora: bool = False
    ) -> Dispatch:
        """The dispatch for a step: write inputs up to ``plan.padded_tokens`` rows, then run."""
        return self.dispatcher.dispatch(num_tokens, uniform_decode, has_lora)

    def run(self, dispatch: Dispatch, num_tokens: int, attn_metadata: Any = None) -> Outputs:
        """Runs one step as ``dispatch`` says; outputs are sliced to ``num_tokens`` rows.

        Raises ``ValueError`` if ``num_tokens`` is negative or larger than the dispatch's
        padded size: those rows were never computed.
        """
        d = dispatch.descriptor
        if not 0 <= num_tokens <= d.num_tokens:
            raise ValueError(
                f"num_tokens: {num_tokens} rows asked of a step dispatched for "
                f"{d.num_tokens} padded tokens; pass the count given to plan() "
                "(0 <= num_tokens <= plan.padded_tokens)"
            )
        if dispatch.mode is GraphMode.FULL:
            entry = self._full.entries.get(d)
            if entry is None:
                raise RuntimeError(
                    f"no FULL graph was captured for {d}; call GraphManager.capture() at "
                    "start-up, before the first step"
                )
            if self.platform.sync_before_replay:
                self.platform.synchronize()
            entry.graph.replay()
            return self._outputs[num_tokens]
        with forward_context(dispatch.mode, d, attn_metadata):
            out = self.step(d)
        if d.num_tokens == num_tokens:
            return out
        if isinstance(out, (tuple, list)):
            return tuple(t[:num_tokens] for t in out)
        return out[:num_tokens]

    def graph(self, descriptor: BatchDescriptor) -> Graph:
        """The FULL graph captured for ``descriptor``; raises ``KeyError`` if there is none."""
        return self._full.entries[descriptor].graph

    @property
    def num_graphs(self) -> int:
        """FULL graphs held by this manager (piecewise graphs live in their wrappers)."""
        return len(self._full.entries)

    def release(self) -> None:
        """Destroys every FULL graph at once; the manager must not replay afterwards.
        Safe to call more than once."""
        self.platform.synchronize()
        self._full.reset()


def _as_tuple(out: Outputs) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)
