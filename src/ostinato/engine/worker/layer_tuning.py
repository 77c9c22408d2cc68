"""Fused decoder layers or not, per captured decode size, chosen by measurement.

``KernelOptions.fused_layers`` runs each layer's norm-then-projection pairs as one op. Whether
that is faster depends on the shape, the row count, the tensor-parallel size and the GPU: on
two H200s the 8 B shape's one-row step took 4.65 ms fused against 3.23 ms unfused, where the
1.5 B shape is 5% faster fused. So at first start every captured size of at most ``MAX_ROWS``
rows runs a decode step both ways, each inside a CUDA graph as the decode graphs run it, and
a size where the unfused layers are faster by ``MARGIN`` runs them
(``DecoderModel.unfused_rows``).

Guarantees: every rank of a tensor-parallel group makes the same choice (the timings are the
slowest rank's, and the ranks measure or read the cache together); the choice is kept in the
compile cache beside the GEMM plans, keyed by everything it depended on, so a later start
measures nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ostinato.distributed.collectives import every_rank, largest_over_group
from ostinato.engine.kernels.gemm_launch import MAX_ROWS
from ostinato.engine.kernels.launch import compile_ahead
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.worker.compile_cache import CompileCache
from ostinato.platform.base import Held
from ostinato.platform.cuda import captured_calls, held_replays_us

logger = logging.getLogger(__name__)

MARGIN = 0.01
"""How much faster the unfused layers must measure to be chosen (below it: noise, and the
fused ops launch fewer kernels)."""

StepTimer = Callable[[int, bool], float]
"""``(rows, unfused) -> µs`` of one decode step of ``rows`` rows, the layers fused or not."""


@dataclass(frozen=True)
class LayerTiming:
    """One captured size's decode step, fused and unfused (µs, the slowest rank's)."""

    rows: int
    fused_us: float
    unfused_us: float

    @property
    def unfused_wins(self) -> bool:
        """Whether this size runs the layers unfused."""
        return self.unfused_us * (1 + MARGIN) <= self.fused_us


def plan_layers(
    model: DecoderModel,
    rows: Sequence[int],
    timer: StepTimer,
    cache: CompileCache | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[LayerTiming]:
    """Sets ``model.unfused_rows`` to the sizes of ``rows`` (those of at most ``MAX_ROWS``)
    where ``timer`` found the unfused layers faster, or to what ``cache`` holds for this
    model; returns the timings (empty where nothing was measured). Collective over
    ``group`` where one is given."""
    model.unfused_rows = frozenset()
    sizes = _sizes(model, rows)
    if not sizes:
        return []
    key = _cache_key(model, sizes, cache)
    stored = cache.load_plans() if cache is not None else {}
    if every_rank(key in stored, group):
        assert key is not None  # (found in the cache)
        model.unfused_rows = frozenset(stored[key])
        return []
    times = largest_over_group([[timer(r, False), timer(r, True)] for r in sizes], group)
    timings = [LayerTiming(r, f, u) for r, (f, u) in zip(sizes, times, strict=True)]
    chosen = [t.rows for t in timings if t.unfused_wins]
    model.unfused_rows = frozenset(chosen)
    logger.info("ostinato: fused layers measured slower at rows %s: unfused there", chosen)
    if cache is not None and key is not None:
        cache.store_plans({key: chosen})
    return timings


def store_layer_plan(model: DecoderModel, rows: Sequence[int], cache: CompileCache | None) -> None:
    """Stores ``model.unfused_rows`` as the layer plan over ``rows``, under the key
    ``plan_layers`` reads for the model's GEMM plans as they are now (a plan changed after
    its measurement: ``KernelPlan.keep_rules_at``)."""
    sizes = _sizes(model, rows)
    key = _cache_key(model, sizes, cache) if sizes else None
    if cache is not None and key is not None:
        cache.store_plans({key: sorted(r for r in model.unfused_rows if r in sizes)})


def layer_plan_cached(model: DecoderModel, rows: Sequence[int], cache: CompileCache | None) -> bool:
    """Whether ``plan_layers`` with these arguments would measure nothing (its plan is
    in ``cache``, or there is nothing to plan), for the GEMM plans ``model`` has now.
    Reads only; one rank's answer."""
    sizes = _sizes(model, rows)
    if not sizes:
        return True
    key = _cache_key(model, sizes, cache)
    return key is not None and cache is not None and key in cache.load_plans()


def _sizes(model: DecoderModel, rows: Sequence[int]) -> list[int]:
    """The sizes a layer plan covers: those of ``rows`` the fused ops take (none without
    them)."""
    return sorted({r for r in rows if r <= MAX_ROWS}) if model.kernels.fused_layers else []


def _cache_key(model: DecoderModel, sizes: list[int], cache: CompileCache | None) -> str | None:
    device = model.embed_tokens.weight.device
    return cache.plan_key(device, layer_key(model), sizes, "layers") if cache else None


def layer_key(model: DecoderModel) -> list[object]:
    """What a layer plan depends on besides the device and the sizes: the model's shape
    and dtype, the tensor-parallel size, the launch options, the attention backend's
    placement of RoPE and the projections' GEMM plans (set before this is measured)."""
    c, w = model.config, model.embed_tokens.weight
    plans = repr([linear.plan for linear, _ in model.linears()]).encode()
    # compile_ahead only moves compile time: a plan measured with it holds without it.
    kernels = replace(model.kernels, compile_ahead=False)
    return [
        c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
        c.vocab_size, w.dtype, model.tp.size, kernels, model.rope_in_attention,
        hashlib.sha256(plans).hexdigest()[:16],
    ]  # fmt: skip


def graph_timer(
    model: DecoderModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    context: Callable[[int], AbstractContextManager[object]],
    rows_ahead: Sequence[int] = (),
    steps: int = 4,
    replays: int = 5,
    turn: Held = contextlib.nullcontext,
) -> StepTimer:
    """A ``StepTimer`` on the GPU: ``steps`` decode steps of the model's ``logits`` over the
    first rows of the persistent ``input_ids`` and ``positions``, inside ``context(rows)``
    (a decode graph's padding rows and attention context), captured in one CUDA graph and
    replayed ``replays`` times; the first step runs eagerly (kernels compile outside the
    capture). With ``rows_ahead`` (``KernelOptions.compile_ahead``), the first call first
    queues that eager step for each of those sizes (at most ``MAX_ROWS``), fused and
    unfused, inside ``launch.compile_ahead()``: the layers' kernels of every variant the
    timings launch compile together (processes or threads), not one after another.
    The variant is this thread's alone (``DecoderModel.unfused_here``). A background
    measurement (``turn()``: its hold of the device between steps) holds the turn for
    each timed replay apart (``held_replays_us``: the median), so no step's work is
    timed with it; the eager step, whose kernels queue behind the steps' on the stream
    they share (the projections' split-K counters are used by one kernel at a time), the
    capture, which runs nothing, and the compile-ahead pass, which launches nothing, hold
    none. ``input_ids``, ``positions`` and what ``context`` writes must then be the
    measurement's own."""
    ahead = sorted({r for r in rows_ahead if r <= MAX_ROWS})

    def variant(rows: int, unfused: bool) -> AbstractContextManager[None]:
        return model.unfused_here(frozenset({rows}) if unfused else frozenset())

    def eager(rows: int) -> Callable[[], torch.Tensor]:
        ids, pos = input_ids[:rows], positions[:rows]
        step = lambda: model.logits(ids, pos)  # noqa: E731
        step()
        return step

    def step_us(rows: int, unfused: bool) -> float:
        if ahead:
            with compile_ahead():
                for r in ahead:
                    for u in (False, True):
                        with variant(r, u), context(r), torch.cuda.device(input_ids.device):
                            eager(r)
            ahead.clear()
        with variant(rows, unfused), torch.cuda.device(input_ids.device), context(rows):
            step = eager(rows)
            graph = captured_calls(step, steps)
            return held_replays_us(graph, replays, turn) / steps

    return step_us
