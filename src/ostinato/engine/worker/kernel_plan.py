"""A runner's kernel planning: the projections' GEMM plans (measured small-GEMM plans with
``KernelOptions.small_gemm``, the Triton GEMM by rule with ``fused_layers``) and the
one-time compilation of the model's pieces and the engine's Triton kernels.

Guarantees: the plans are set once, before anything compiles (they are constants of the
compiled graph); the compile runs once, on padding rows, and with ``compile_ahead`` the
engine's Triton kernels compile together (``launch.compile_ahead``).

A start whose graphs are of the eager model and captured in the background may defer the
measurement (``plan(defer=True)``): where the compile cache lacks a plan, the start runs
the plans ``fused_layers`` gives by rule and the layers fused at every size, and
``measure_deferred`` measures the real ones once the graphs serve (on the capture
thread, one timing per hold of the device), sets and stores them, and names the sizes
whose kernels changed, for the runner to capture again. The rules' split-K counters stay
alive: graphs captured with them read them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Iterator
from typing import NamedTuple

import torch

from ostinato.distributed.collectives import every_rank
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.kernels.gemm_launch import MAX_ROWS, counters_needed
from ostinato.engine.kernels.launch import compile_ahead, layout_rows, start_workers
from ostinato.engine.kernels.launch_rules import rules
from ostinato.engine.kernels.options import KernelOptions
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.model.linear import Linear, plan_entry
from ostinato.engine.sample.greedy import greedy_tokens
from ostinato.engine.worker.compile_cache import CompileCache
from ostinato.engine.worker.gemm_tuning import (
    GemmTiming,
    default_plan_for,
    default_plans,
    plan_small_gemms,
    small_gemm_plans_cached,
    store_plans_of,
)
from ostinato.engine.worker.inputs import StepInputs
from ostinato.engine.worker.layer_tuning import (
    LayerTiming,
    StepTimer,
    layer_plan_cached,
    plan_layers,
    store_layer_plan,
)
from ostinato.piecewise import PiecewiseBackend
from ostinato.platform.base import Held
from ostinato.platform.cuda import timing_pool

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
        # Set by a background start whose thread compiles ahead (``compile_first``),
        # until ``compile_on`` returns: the steps meanwhile compile their own first.
        self.steps_meanwhile = False
        self._stepped: set[Hashable] = set()
        self.deferred = False  # plans by rule, measured later (``plan(defer=True)``)
        self.started_deferred = False  # (stays set once the measurement is done)
        self._retired: list[torch.Tensor] = []  # counters the rules' graphs read
        self._rules: list[tuple[tuple[int, ...], bool]] = []  # each linear's, when deferred

    @property
    def compiles_kernels(self) -> bool:
        """Whether the engine's Triton kernels are still to be compiled ahead."""
        return self._kernels_pending

    @torch.inference_mode()
    def plan(self, defer: bool = False) -> list[GemmTiming]:
        """Measures and sets the small-GEMM plans once, then with ``fused_layers`` gives
        the Triton GEMM to every layer projection left without one and, with a
        ``layer_timer``, measures at which of ``layer_rows`` the layers run fused
        (``layer_tuning``); returns the GEMM measurements (empty when not asked for).
        With ``defer``, where a plan is not in the compile cache, measures nothing and
        sets the rules' plans instead (``deferred``; module docstring). Not under tensor
        parallelism: the ranks would have to agree on the deferral."""
        if self.timings is None:
            if defer and not self._cached():
                self.timings = []
                self._set_rules()
                self.deferred = self.started_deferred = True
            else:
                self.timings = self._measure(self.layer_timer, contextlib.nullcontext)
                planned = bool(self.small_gemm_rows) or self.layer_timer is not None
                self._ahead_only_after_measuring(planned)
            if self.ahead:  # (the kernels compile next: their workers start meanwhile)
                start_workers()
        return self.timings

    def _measure(self, layer_timer: StepTimer | None, turn: Held) -> list[GemmTiming]:
        """The plans measured (or read from the cache) and set; the GEMM timings. Every
        timing graph in one ``timing_pool``: the measurement holds one graph's memory."""
        model, pdl = self.model, self.kernels.pdl
        rows, cache = self.small_gemm_rows, self.compile_cache
        start = time.perf_counter()
        timings = []
        with timing_pool():
            if rows:
                timings = plan_small_gemms(model.linears(), rows, pdl, cache=cache, turn=turn)
            self._set_rules()
            self.gemm_seconds = time.perf_counter() - start
            if layer_timer is not None:
                group = model.tp.group
                self.layer_timings = plan_layers(model, self.layer_rows, layer_timer, cache, group)
        self.layer_seconds = time.perf_counter() - start - self.gemm_seconds
        return timings

    def _set_rules(self) -> None:
        """With ``fused_layers``, the Triton GEMM by rule to every projection without a
        plan; the LM head only where ``LaunchRules.plan_lm_head`` says (once a step, and
        the widest GEMM, where a tile picked by rule risks the most)."""
        if self.kernels.fused_layers:
            default_plans(self.model.linears(lm_head=rules().plan_lm_head), self.kernels.pdl)

    def _cached(self) -> bool:
        """Whether every plan ``plan`` needs is in the compile cache (or none is needed).
        Where the GEMM plans all are, the model gets them here: the layer plan's key
        depends on them."""
        model, rows, pdl = self.model, self.small_gemm_rows, self.kernels.pdl
        cache = self.compile_cache
        if rows and not small_gemm_plans_cached(model.linears(), rows, pdl, cache=cache):
            return False
        if self.layer_timer is None:
            return True
        if rows:
            plan_small_gemms(model.linears(), rows, pdl, cache=cache)  # (reads only)
        self._set_rules()
        return layer_plan_cached(model, self.layer_rows, cache)

    @torch.inference_mode()
    def measure_deferred(self, layer_timer: StepTimer | None, turn: Held) -> frozenset[int]:
        """After ``plan(defer=True)`` deferred, once the graphs serve: measures the plans
        (``layer_timer`` times the layers; every timing inside ``turn()``), sets them on
        the model and stores them in the compile cache; returns the row counts whose
        kernels changed (their graphs still run the rules' kernels). Once."""
        if not self.deferred:
            raise RuntimeError("measure_deferred: the plans were not deferred")
        before = self._kernels_by_rows()
        linears = [linear for linear, _ in self.model.linears()]
        # Graphs captured with the rules' plans read these counters: kept alive.
        self._retired += [linear.counters for linear in linears]
        self._rules = [(tuple(linear.plan), linear.pdl) for linear in linears]
        self.timings = self._measure(layer_timer, turn)
        self.deferred = False  # (only now: ``ModelRunner.release`` waits while it is set)
        after = self._kernels_by_rows()
        return frozenset(r for r in before if before[r] != after[r])

    @torch.inference_mode()
    def compile_measured(self, inputs: StepInputs, rows: frozenset[int]) -> None:
        """After ``measure_deferred`` changed the kernels of ``rows`` (with
        ``compile_ahead``): its passes again (``_kernels_ahead``) on the measured plans, up
        to ``MAX_ROWS`` rows (where plans apply), so that the graphs captured again for
        those sizes compile nothing at their launches, where a compile holds the step turn
        (or a blocking start). Launches nothing; outside any turn."""
        if rows and self.ahead:
            self._kernels_pending = True
            with self._kernels_ahead(inputs, MAX_ROWS):
                pass

    @torch.inference_mode()
    def keep_rules_at(self, rows: frozenset[int], turn: Held) -> None:
        """After ``measure_deferred``: at row counts ``rows``, where the rules' graphs
        replayed faster than the measured plans' (``DeferredPlans``), the rules' kernels
        again: their GEMM plan entries, fused layers and PDL on the model (inside ``turn()``,
        which does no device work: the new split-K counters are made before it) and in
        the compile cache, so that a later start captures what won here rather than what
        the timings of single kernels chose. The measured plans' counters stay alive for
        the graphs captured with them."""
        if not rows or not self._rules:
            return
        swaps, changed = self._rules_swaps(rows)
        with turn():
            for swap in swaps:
                self._retired.append(swap.linear.counters)
                swap.linear.use_plan(swap.plan, swap.counters, swap.pdl)
            self.model.unfused_rows = self.model.unfused_rows - rows
            self.model.no_pdl_rows = self.model.no_pdl_rows - rows
        # Only the plans that changed: a later start reads them back into what the model
        # now holds (an unchanged plan stored again could read back otherwise).
        rows_planned, cache = self.small_gemm_rows, self.compile_cache
        if rows_planned and changed:
            store_plans_of(changed, rows_planned, self.kernels.pdl, cache=cache)
        if self.layer_timer is not None:
            store_layer_plan(self.model, self.layer_rows, cache)

    def _rules_swaps(self, rows: frozenset[int]) -> tuple[list[_Swap], list[tuple[Linear, bool]]]:
        """``keep_rules_at``'s new plans, their counters made (a device allocation and a
        fill each: inside the turn they held the steps 3.3 ms on an H200, the 1.5 B
        shape's), and the projections whose rules' entries changed: the rules' entries
        at ``rows``, then, where a projection is left with no Triton entry, the plan
        ``_set_rules`` gives it (as a later start, reading the plans, does)."""
        plans: dict[Linear, tuple[tuple[int, ...], bool]] = {}
        changed = []
        for (linear, swiglu), (rules_plan, pdl) in zip(
            self.model.linears(), self._rules, strict=True
        ):
            plan = _rows_from(linear.plan, rules_plan, rows)
            if plan != tuple(linear.plan):
                # A side without a plan has PDL off, which says nothing of the other
                # side's Triton entries: they keep the PDL they were measured with.
                plans[linear] = (plan, pdl or linear.pdl)
                changed.append((linear, swiglu))
        if self.kernels.fused_layers:
            for linear, swiglu in self.model.linears(lm_head=rules().plan_lm_head):
                held = plans[linear][0] if linear in plans else tuple(linear.plan)
                default = default_plan_for(linear, swiglu, held)
                if default is not None:
                    plans[linear] = (default, self.kernels.pdl)
        swaps = [
            _Swap(linear, plan, linear.new_counters(_counters(linear, plan)), pdl)
            for linear, (plan, pdl) in plans.items()
        ]
        return swaps, changed

    def _kernels_by_rows(self) -> dict[int, tuple[object, ...]]:
        """What decides the kernels a step of each row count a plan covers launches:
        every projection's plan entry, whether the layers run fused and with PDL."""
        linears = [linear for linear, _ in self.model.linears()]
        unfused, no_pdl = self.model.unfused_rows, self.model.no_pdl_rows
        return {
            r: (r in unfused, r in no_pdl, *(plan_entry(linear.plan, r) for linear in linears))
            for r in range(1, MAX_ROWS + 1)
        }

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
        try:
            if not pieces and not self._kernels_pending:
                return 0.0
            start = time.perf_counter()
            with self._kernels_ahead(inputs):
                if pieces:
                    n = self.limits.max_num_batched_tokens
                    with self.padding(inputs, n):
                        forward(inputs.input_ids[:n], inputs.positions[:n])
        finally:
            self.steps_meanwhile = False  # (the steps' kernels are all compiled, or never)
        synchronize()
        return time.perf_counter() - start

    def compile_first(self, key: Hashable, step: Callable[[], object]) -> None:
        """While this start's kernels compile beside the steps (``steps_meanwhile``, until
        ``compile_on`` returns): the first eager step of each ``key`` runs ``step`` (its
        own work on its own inputs, launching nothing) inside ``compile_ahead(first=True)``
        (ahead of the worker processes' queue, where they were started, else on threads),
        so that its dozen kernels compile together rather than one after another at
        their launches (an H200's first 1.5 B step took 7.1-8.4 s so, every cache empty).
        Elsewhere, nothing."""
        if not self.steps_meanwhile or key in self._stepped:
            return
        self._stepped.add(key)
        with compile_ahead(first=True):
            step()

    @contextlib.contextmanager
    def _kernels_ahead(self, inputs: StepInputs, max_rows: int | None = None) -> Iterator[None]:
        """Once (again where ``compile_measured`` asks), with ``compile_ahead``, up to
        ``max_rows`` rows where given: inside, the engine's Triton kernels compile on a
        pool (``launch.compile_ahead``: processes or threads), queued first by eager passes
        of the model at every layout the steps launch (``layout_rows``: every row count
        the small GEMM plans; above, with and without PDL, attention splitting its keys
        or not), each followed by the decode graphs' greedy argmax over a few of its
        rows; up to ``MAX_ROWS`` rows both as a decode graph runs the model and as a mixed
        step does (its hidden states, then the LM head alone on its logit rows).
        Nothing launched inside runs, so the caller's compiled first pass overlaps the
        compilations and its output is not to be read."""
        if not self._kernels_pending:
            yield
            return
        self._kernels_pending = False
        with compile_ahead():
            largest = self.limits.max_num_batched_tokens
            for n in layout_rows(min(largest, max_rows or largest), MAX_ROWS):
                ids, positions = inputs.input_ids[:n], inputs.positions[:n]
                # (as the steps launch: without PDL at a size measured faster so)
                with self.padding(inputs, n), self.model.launches_at(n):
                    if n <= MAX_ROWS:  # as a mixed step runs it, and the decode graphs
                        # (a mixed step's logit rows: the LM head alone, after the graph)
                        self.model.compute_logits(self.model(ids, positions))
                        logits = self.model.logits(ids, positions)
                    else:
                        # The argmax's layouts differ only in PDL: a few rows take the
                        # same one as ``n`` rows, without their whole vocabulary of logits.
                        hidden = self.model(ids, positions)[: rules().pdl_max_rows + 1]
                        logits = self.model.compute_logits(hidden)
                    greedy_tokens(logits, self.kernels.pdl)
            yield


class _Swap(NamedTuple):
    """A projection's next plan, its split-K counters (made), and its PDL flag."""

    linear: Linear
    plan: tuple[int, ...]
    counters: torch.Tensor
    pdl: bool


def _counters(linear: Linear, plan: tuple[int, ...]) -> int:
    """The split-K counters ``plan`` needs on ``linear`` (none without a plan)."""
    return counters_needed(linear.weight.shape[0]) if plan else 0


def _rows_from(
    plan: tuple[int, ...], rules: tuple[int, ...], rows: frozenset[int]
) -> tuple[int, ...]:
    """``plan`` with ``rules``' entries at ``rows``, as long as ``plan`` (the form a plan
    read from the cache takes) unless ``rows`` reach past it; no plan where every entry
    is cuBLAS's."""
    size = max(len(plan), max(rows) + 1)
    mixed = tuple(plan_entry(rules if r in rows else plan, r) for r in range(size))
    return mixed if any(mixed) else ()
