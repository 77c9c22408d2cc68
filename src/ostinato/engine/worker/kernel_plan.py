"""A runner's kernel planning: the projections' GEMM plans (measured small-GEMM plans with
``KernelOptions.small_gemm``, the Triton GEMM by rule with ``fused_layers``) and the
one-time compilation of the model's pieces and the engine's Triton kernels.

Guarantees: the plans are set once, before anything compiles (they are constants of the
compiled graph); the compile runs once, on padding rows, and with ``compile_ahead`` the
engine's Triton kernels compile together (``launch.compile_ahead``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from ostinato.distributed.collectives import every_rank
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.kernels.gemm_launch import MAX_ROWS
from ostinato.engine.kernels.launch import compile_ahead, layout_rows
from ostinato.engine.kernels.launch_rules import rules
from ostinato.engine.kernels.options import KernelOptions
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.sample.greedy import greedy_tokens
from ostinato.engine.worker.compile_cache import CompileCache
from ostinato.engine.worker.gemm_tuning import GemmTiming, default_plans, plan_small_gemms
from ostinato.engine.worker.inputs import StepInputs
from ostinato.engine.worker.layer_tuning import LayerTiming, StepTimer, plan_layers
from ostinato.piecewise import PiecewiseBackend

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, positions) -> hidden
Padding = Callable[[StepInputs, int], contextlib.AbstractContextManager]  # an eager step's


class KernelPlan:
    """Plans and compiles once for one runner (see the module docstring).
    ``small_gemm_rows``: the row counts the small-GEMM plans cover (the captured sizes);
    ``timings``: what planning measured (None before ``plan``); ``compile_seconds``;
    ``gemm_seconds`` and ``layer_seconds``: what the GEMM and layer plans took;
    ``ahead``: whether this start compiles the kernels ahead (``compile_ahead``, unless
    every plan came from the cache: ``plan``)."""

    def __init__(
        self,
        model: DecoderModel,
        kernels: KernelOptions,
        limits: EngineLimits,
        small_gemm_rows: tuple[int, ...],
        compile_cache: CompileCache | None,
        padding: Padding,
        layer_timer: StepTimer | None = None,
        layer_rows: tuple[int, ...] = (),
    ) -> None:
        self.model, self.kernels, self.limits = model, kernels, limits
        self.small_gemm_rows = small_gemm_rows
        self.compile_cache = compile_cache
        self.padding = padding
        self.layer_timer, self.layer_rows = layer_timer, layer_rows
        self.timings: list[GemmTiming] | None = None
        self.layer_timings: list[LayerTiming] = []  # what the layer plan measured
        self.compile_seconds = 0.0
        self.gemm_seconds = self.layer_seconds = 0.0  # what ``plan`` took, by plan
        # Whether this start compiles ahead (``plan`` may turn it off), and whether the
        # pass that does is still to come (once).
        self.ahead = kernels.compile_ahead
        self._kernels_pending = kernels.compile_ahead

    @property
    def compiles_kernels(self) -> bool:
        """Whether the engine's Triton kernels are still to be compiled ahead."""
        return self._kernels_pending

    @torch.inference_mode()
    def plan(self) -> list[GemmTiming]:
        """Measures and sets the small-GEMM plans once, then with ``fused_layers`` gives
        the Triton GEMM to every layer projection left without one and, with a
        ``layer_timer``, measures at which of ``layer_rows`` the layers run fused
        (``layer_tuning``); returns the GEMM measurements (empty when not asked for)."""
        if self.timings is None:
            model, pdl = self.model, self.kernels.pdl
            rows = self.small_gemm_rows
            start = time.perf_counter()
            self.timings = (
                plan_small_gemms(model.linears(), rows, pdl, cache=self.compile_cache)
                if rows
                else []
            )
            if self.kernels.fused_layers:
                # The LM head only where LaunchRules.plan_lm_head says: once a step,
                # and the widest GEMM, where a tile picked by rule risks the most.
                default_plans(model.linears(lm_head=rules().plan_lm_head), pdl)
            self.gemm_seconds = time.perf_counter() - start
            if self.layer_timer is not None:
                self.layer_timings = plan_layers(
                    model, self.layer_rows, self.layer_timer, self.compile_cache, model.tp.group
                )
            self.layer_seconds = time.perf_counter() - start - self.gemm_seconds
            self._ahead_only_after_measuring(planned=bool(rows) or self.layer_timer is not None)
        return self.timings

    def _ahead_only_after_measuring(self, planned: bool) -> None:
        """Compile-ahead stays on only where planning measured something. Plans read
        back from the compile cache mean an earlier start compiled these kernels: its
        passes would only look them up, on the capture thread beside the first steps
        (an H200's 1.5 B start answered 0.3 s later with them). Decided by every rank
        together: the passes run the model, whose all-reduces every rank must join."""
        cached = planned and not self.timings and not self.layer_timings
        if self.ahead and every_rank(cached, self.model.tp.group):
            self.ahead = self._kernels_pending = False

    @torch.inference_mode()
    def compile_on(
        self,
        inputs: StepInputs,
        forward: Forward,
        piecewise: PiecewiseBackend | None,
        synchronize: Callable[[], None],
    ) -> float:
        """Compiles ``forward`` (the piecewise backend's pieces) once, at the largest size,
        on padding rows of ``inputs``, with the engine's Triton kernels first where asked;
        seconds (0.0 when there was nothing left to compile)."""
        pieces = piecewise is not None and not piecewise.stats.compiles
        if not pieces and not self._kernels_pending:
            return 0.0
        start = time.perf_counter()
        with self._kernels_ahead(inputs):
            if pieces:
                n = self.limits.max_num_batched_tokens
                with self.padding(inputs, n):
                    forward(inputs.input_ids[:n], inputs.positions[:n])
        synchronize()
        return time.perf_counter() - start

    @contextlib.contextmanager
    def _kernels_ahead(self, inputs: StepInputs) -> Iterator[None]:
        """Once, with ``compile_ahead``: inside, the engine's Triton kernels compile on a
        pool (``launch.compile_ahead``: processes or threads), queued first by one eager pass of the
        model per layout the steps launch (``layout_rows``: with and without PDL,
        attention splitting its keys or not), each followed by the decode graphs' greedy
        argmax over a few of its rows. Nothing launched inside runs, so the caller's
        compiled first pass overlaps the compilations and its output is not to be read."""
        if not self._kernels_pending:
            yield
            return
        self._kernels_pending = False
        with compile_ahead():
            for n in layout_rows(self.limits.max_num_batched_tokens):
                ids, positions = inputs.input_ids[:n], inputs.positions[:n]
                with self.padding(inputs, n):
                    if n <= MAX_ROWS:  # as the decode graphs run it
                        logits = self.model.logits(ids, positions)
                    else:
                        # The argmax's layouts differ only in PDL: a few rows take the
                        # same one as ``n`` rows, without their whole vocabulary of logits.
                        hidden = self.model(ids, positions)[: rules().pdl_max_rows + 1]
                        logits = self.model.compute_logits(hidden)
                    greedy_tokens(logits, self.kernels.pdl)
            yield
