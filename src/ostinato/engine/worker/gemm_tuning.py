"""The start-up measurement behind the small-GEMM plans: cuBLAS against the Triton GEMM,
per projection shape and row count, timed the way a decode graph runs them.

Each candidate (cuBLAS, and each of ``triton_gemm.CONFIGS``) is captured as a CUDA graph
of ``REPEATS`` back-to-back calls and replayed; its time per call is the replay time
over ``REPEATS``, so host launch cost is out of it and cuBLAS's split-K reduce kernel is
in it. Which one a (shape, rows) runs: ``triton_chosen`` (the Triton GEMM unless cuBLAS
wins by a margin of ``min_gain``: inside a step the Triton GEMM measured faster than its
timing alone predicts). SwiGLU gate/up projections compare the Triton GEMM with the
activation in its epilogue against cuBLAS followed by the one-kernel SiLU·mul. Only 16-bit
weights are tried (the Triton GEMM's dot would round float32 inputs to tf32).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ostinato.engine.kernels.gemm_launch import counters_needed
from ostinato.engine.kernels.launch_rules import rules
from ostinato.engine.model.linear import Linear, plan_entry
from ostinato.engine.worker.compile_cache import CompileCache
from ostinato.platform import exclusive_device
from ostinato.platform.base import Held
from ostinato.platform.cuda import graph_call_us

logger = logging.getLogger(__name__)

REPEATS = 20
GEMM_RULE = "triton unless cublas wins by the gain"
"""Part of a stored plan's key (``triton_chosen``): a plan chosen by an earlier rule is
measured again."""
GemmKey = tuple[int, int, torch.dtype, bool, bool]  # (n, k, dtype, swiglu, bias)


@dataclass(frozen=True)
class GemmShape:
    """A projection as the GEMM sees it: ``[rows, k] x [n, k]^T`` (with ``swiglu``,
    followed by SiLU·mul of the two output halves)."""

    n: int
    k: int
    dtype: str
    swiglu: bool
    bias: bool


@dataclass(frozen=True)
class GemmTiming:
    """One (shape, rows) measured: µs per call for cuBLAS and the best Triton config,
    and the choice (``config`` is the 1-based index into ``CONFIGS``, 0 for cuBLAS)."""

    shape: GemmShape
    rows: int
    cublas_us: float
    triton_us: float
    config: int


def _graph_us(fn: Callable[[], object], device: torch.device, turn: Held) -> float:
    """µs per call of ``fn`` (``graph_call_us``: its inputs are its own, so the capture
    runs beside steps and each timed replay holds ``turn()``)."""
    # The warm-up call (cuBLAS's handle and heuristics; Triton's kernels compiled ahead,
    # loaded) beside the steps too: it touches nothing of theirs, and in the turn its host
    # time (0.8 ms on average on an H200, up to 2.6) held them. Not beside another
    # thread's capture (``exclusive_device``), which its launches would break.
    with exclusive_device():
        fn()
    with torch.cuda.device(device):
        return graph_call_us(fn, REPEATS, turn=turn)


def _candidates(
    linear: Linear, swiglu: bool, rows: int, pdl: bool, device: torch.device
) -> tuple[Callable[[], object], list[tuple[int, Callable[[], object]]]]:
    """cuBLAS's call and each fitting Triton config's (its 1-based index into
    ``CONFIGS``) on one random input of ``rows`` rows: the calls measured, the same
    arguments whether they compile ahead or run."""
    from ostinato.engine.kernels import small_gemm as triton_gemm
    from ostinato.engine.kernels.silu_mul import silu_mul

    w, b = linear.weight, linear.bias
    n, k = w.shape
    # A generator of its own: the deferred measurement draws on the capture thread beside
    # steps, and another engine's capture would hold the default generator.
    draw = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, k, device=device, dtype=w.dtype, generator=draw)
    counters = torch.zeros(triton_gemm.counters_needed(n), dtype=torch.int32, device=device)

    def cublas() -> object:
        y = torch.nn.functional.linear(x, w, b)
        return silu_mul(y, pdl) if swiglu else y

    def call(config: object) -> Callable[[], object]:
        return lambda: triton_gemm.small_gemm(x, w, b, counters, config, swiglu, pdl)

    fitting = [
        (i, call(config))
        for i, config in enumerate(triton_gemm.CONFIGS, start=1)
        if triton_gemm.fits(config, rows, k, 2 if swiglu else 1)
    ]
    return cublas, fitting


def _measure(
    linear: Linear,
    swiglu: bool,
    rows: int,
    pdl: bool,
    device: torch.device,
    turn: Held = contextlib.nullcontext,
) -> GemmTiming:
    """cuBLAS and every fitting candidate timed at ``rows`` rows; a step waits at most
    one timed replay of one candidate (``_graph_us``). Holding the step turn through
    whole timings, a background start's steps waited up to 0.12 s on the H200 (1.5 B
    shape, slices of 0.05 s and one timing over; the LM head's candidates held it 0.45 s
    together)."""
    cublas, fitting = _candidates(linear, swiglu, rows, pdl, device)
    us = {i: _graph_us(fn, device, turn) for i, fn in [(0, cublas), *fitting]}
    cublas_us = us.pop(0)
    best = min(us, key=us.__getitem__, default=0)
    best_us = us.get(best, float("inf"))
    w = linear.weight
    n, k = w.shape
    shape = GemmShape(n, k, str(w.dtype).removeprefix("torch."), swiglu, linear.bias is not None)
    return GemmTiming(shape, rows, cublas_us, best_us, best)


def _compile_candidates(
    linears: Sequence[tuple[Linear, bool]], sizes: Sequence[int], pdl: bool
) -> None:
    """Compiles every Triton kernel ``_measure`` will time for ``linears`` together
    (``launch.compile_ahead``: processes or threads), running none: each Triton
    candidate, and the SiLU·mul after cuBLAS's gate/up (cuBLAS itself runs, on the
    candidates' own input). One at a time, at their first calls, they made a cold
    start's planning a minute longer (1.5 B shape, H200)."""
    from ostinato.engine.kernels.launch import compile_ahead

    with compile_ahead():
        for linear, swiglu in linears:
            for r in sizes:
                cublas, fitting = _candidates(linear, swiglu, r, pdl, linear.weight.device)
                for fn in (cublas, *(fn for _, fn in fitting)):
                    fn()


def triton_chosen(timing: GemmTiming, min_gain: float) -> bool:
    """Whether a (shape, rows) measured as ``timing`` runs the Triton GEMM: wherever a
    Triton config fits, unless cuBLAS measured at least ``min_gain`` faster. The margin
    is in the Triton GEMM's favour because a GEMM timed alone mispredicts the step it
    runs in, on the whole to cuBLAS's advantage. On an H100, swapping single plan entries
    inside a pipelined step (``benchmarks/results/gemm_rule_pdl``): without PDL, every
    entry of both decode shapes within 3% either way alone ran the step faster on Triton,
    up to 84 µs, and the two that were 10% slower on Triton alone ran it slower; with
    PDL, the Triton GEMM took 1.1-5.5x its saving alone off the 8 B shape's step in QKV,
    O and gate/up, and of six 8 B starts whose plans differed only in a near tie, the
    three on Triton stepped at 6.110-6.118 ms against 6.197-6.200. It still misleads
    where a GEMM faster alone runs the step slower (with PDL, the down projection: on the
    1.5 B shape 8-11% faster alone and 9-23 µs slower in the step, on the 8 B shape 61 µs
    slower at 16 rows); only timings of whole steps (the layer plan, the recapture
    check) see that."""
    if timing.config == 0:
        return False
    return timing.cublas_us * (1 + min_gain) > timing.triton_us


def plan_small_gemms(
    linears: Sequence[tuple[Linear, bool]],
    rows: Sequence[int],
    pdl: bool,
    min_gain: float = 0.03,
    cache: CompileCache | None = None,
    turn: Held = contextlib.nullcontext,
) -> list[GemmTiming]:
    """Measures every distinct projection shape of ``linears`` (``(linear, swiglu)``)
    at each row count in ``rows`` (those above ``MAX_ROWS`` are skipped) and
    gives each linear its plan (``Linear.use_plan``): Triton where ``triton_chosen``
    says, else cuBLAS. Returns the measurements (none for a
    plan found in ``cache``, where new plans are stored). Linears with 32-bit weights,
    or off CUDA, get an empty plan (plain ``nn.Linear``). The candidates of the shapes
    to measure compile together first; each measurement runs inside ``turn()`` (a
    background measurement's hold of the device between steps)."""
    found = _lookup(linears, rows, pdl, min_gain, cache)
    if found.missing and found.sizes:
        _compile_candidates(list(found.missing.values()), found.sizes, pdl)
    timings: list[GemmTiming] = []
    measured: dict[str, list[int]] = {}
    plans = found.plans
    for linear, swiglu, key, cache_key in found.linears:
        if key is not None and key not in plans:
            assert found.sizes  # (a keyed linear is a CUDA one)
            plan = [0] * (found.sizes[-1] + 1)
            for r in found.sizes:
                t = _measure(linear, swiglu, r, pdl, linear.weight.device, turn)
                timings.append(t)
                if triton_chosen(t, min_gain):
                    plan[r] = t.config
            plans[key] = tuple(plan)
            if cache_key:
                measured[cache_key] = plan
            logger.info("ostinato: small GEMM %s: plan %s", key, plans[key])
        _use(linear, plans[key] if key is not None else (), pdl)
    if cache is not None and measured:
        cache.store_plans(measured)
    return timings


def store_plans_of(
    linears: Sequence[tuple[Linear, bool]],
    rows: Sequence[int],
    pdl: bool,
    min_gain: float = 0.03,
    cache: CompileCache | None = None,
) -> None:
    """Stores each planned projection's plan as it is now on the linear, under the key
    ``plan_small_gemms`` reads for these arguments (a plan changed after its measurement:
    ``KernelPlan.keep_rules_at``)."""
    if cache is None:
        return
    found = _lookup(linears, rows, pdl, min_gain, cache)
    plans: dict[str, list[int]] = {}
    for linear, _, key, cache_key in found.linears:
        if key is not None and cache_key is not None and found.sizes:
            stored = [0] * (found.sizes[-1] + 1)
            for r in found.sizes:
                stored[r] = plan_entry(linear.plan, r)
            plans[cache_key] = stored
    if plans:
        cache.store_plans(plans)


def small_gemm_plans_cached(
    linears: Sequence[tuple[Linear, bool]],
    rows: Sequence[int],
    pdl: bool,
    min_gain: float = 0.03,
    cache: CompileCache | None = None,
) -> bool:
    """Whether ``plan_small_gemms`` with these arguments would measure nothing (every
    plan it needs is in ``cache``, or there is nothing to plan). Reads only."""
    return not _lookup(linears, rows, pdl, min_gain, cache).missing


@dataclass
class _Lookup:
    """What the cache holds for ``plan_small_gemms``' linears: each linear with its
    shape key and cache key (None where it gets no plan), the plans found by shape key,
    one linear per shape key still to measure, and the row counts planned (None before
    a CUDA linear)."""

    linears: list[tuple[Linear, bool, GemmKey | None, str | None]]
    plans: dict[GemmKey, tuple[int, ...]]
    missing: dict[GemmKey, tuple[Linear, bool]]
    sizes: list[int] | None


def _lookup(
    linears: Sequence[tuple[Linear, bool]],
    rows: Sequence[int],
    pdl: bool,
    min_gain: float,
    cache: CompileCache | None,
) -> _Lookup:
    stored = cache.load_plans() if cache is not None else {}
    found = _Lookup([], {}, {}, None)
    for linear, swiglu in linears:
        w = linear.weight
        if w.device.type == "cuda" and found.sizes is None:
            found.sizes = _plan_sizes(rows)  # (needs Triton)
        planned = w.device.type == "cuda" and w.dtype in (torch.float16, torch.bfloat16)
        if not planned or not found.sizes:
            found.linears.append((linear, swiglu, None, None))
            continue
        key = (*w.shape, w.dtype, swiglu, linear.bias is not None)
        extra = f"pdl={pdl} gain={min_gain} rule={GEMM_RULE}"
        cache_key = cache.plan_key(w.device, key, found.sizes, extra) if cache else None
        if key not in found.plans and cache_key in stored:
            found.plans[key] = tuple(stored[cache_key])
        if key not in found.plans:
            found.missing.setdefault(key, (linear, swiglu))
        found.linears.append((linear, swiglu, key, cache_key))
    return found


def _use(linear: Linear, plan: tuple[int, ...], pdl: bool) -> None:
    """Gives ``linear`` ``plan``; one of cuBLAS alone is no plan (plain ``nn.Linear``,
    no split-K counters held). A linear that has the plan already keeps its counters:
    graphs captured with them read them."""
    if linear.plan == (tuple(plan) if any(plan) else ()) and linear.pdl == pdl:
        return
    if any(plan):
        linear.use_plan(plan, counters_needed(linear.weight.shape[0]), pdl)
    else:
        linear.use_plan((), 0, pdl)


def _plan_sizes(rows: Sequence[int]) -> list[int]:
    """The row counts of ``rows`` the small GEMM's one row tile covers (needs Triton)."""
    from ostinato.engine.kernels.gemm_launch import MAX_ROWS

    return sorted({r for r in rows if 1 <= r <= MAX_ROWS})


def default_plans(linears: Sequence[tuple[Linear, bool]], pdl: bool) -> None:
    """Gives every 16-bit CUDA projection of ``linears`` still without a Triton plan and
    with at most ``LaunchRules.small_weight_bytes`` of weight the Triton GEMM at every row count it
    covers, in the config ``gemm_launch.pick_config`` names for its shape: what a model
    with ``KernelOptions.fused_layers`` runs where nothing was measured. Larger weights
    keep cuBLAS (and their fused ops the unfused kernels)."""
    for linear, swiglu in linears:
        plan = default_plan_for(linear, swiglu, linear.plan)
        if plan is not None:
            linear.use_plan(plan, counters_needed(linear.weight.shape[0]), pdl)


def default_plan_for(linear: Linear, swiglu: bool, plan: tuple[int, ...]) -> tuple[int, ...] | None:
    """The plan ``default_plans`` gives ``linear`` if it held ``plan``; None where it
    gives none (a Triton entry in ``plan``, a weight too large, not 16-bit CUDA)."""
    w = linear.weight
    if w.device.type != "cuda" or w.dtype not in (torch.float16, torch.bfloat16):
        return None
    if any(plan) or w.numel() * w.element_size() > rules().small_weight_bytes:
        return None
    return _default_plan(w, swiglu)


def _default_plan(w: torch.Tensor, swiglu: bool) -> tuple[int, ...]:
    """Plan entries by row count (0 rows: cuBLAS): the resident launch up to
    ``LaunchRules.resident_max_rows`` rows where it fits, the shared-memory launch above where it
    fits, else ``pick_config``'s shape."""
    from ostinato.engine.kernels import gemm_launch as g
    from ostinato.engine.kernels.launch import num_sms

    n, k = (w.shape[0] // 2 if swiglu else w.shape[0]), w.shape[1]
    choice = g.pick_config(n, k, num_sms(w.device), swiglu)
    tiles, weight_bytes = 2 if swiglu else 1, w.numel() * w.element_size()
    return (0,) + tuple(
        g.resident_config(k, tiles, weight_bytes, r)
        or g.smem_config(k, tiles, r, weight_bytes)
        or choice
        for r in range(1, g.MAX_ROWS + 1)
    )
