"""Fused decoder layers or not, and PDL or not, per captured decode size, chosen by
measurement.

``KernelOptions.fused_layers`` runs each layer's norm-then-projection pairs as one op. Whether
that is faster depends on the shape, the row count, the tensor-parallel size and the GPU: on
two H200s the 8 B shape's one-row step took 4.65 ms fused against 3.23 ms unfused, where the
1.5 B shape is 5% faster fused. So at first start every captured size of at most ``MAX_ROWS``
rows runs a decode step both ways, each inside a CUDA graph as the decode graphs run it, and
a size where the unfused layers are faster by ``MARGIN`` runs them
(``DecoderModel.unfused_rows``). Where the kernels launch with PDL, both also run without
it, and a size where that is faster by ``MARGIN`` than with PDL steps without it
(``DecoderModel.no_pdl_rows``; the rule in full: ``LayerTiming.chosen``): on the H200 the
8 B shape's 16-row step was 1-3% faster without PDL, where the 1.5 B shape's steps gain
from it at every size.

Guarantees: every rank of a tensor-parallel group makes the same choice (the timings are the
slowest rank's, and the ranks measure or read the cache together); the choice is kept in the
compile cache beside the GEMM plans, keyed by everything it depended on, so a later start
measures nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ostinato.distributed.collectives import every_rank, largest_over_group
from ostinato.engine.kernels.gemm_launch import MAX_ROWS
from ostinato.engine.kernels.launch import compile_ahead, pdl_for, without_pdl
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.worker.compile_cache import CompileCache
from ostinato.platform.base import Held
from ostinato.platform.cuda import captured_calls, held_replays_us

logger = logging.getLogger(__name__)

MARGIN = 0.01
"""How much faster the unfused layers, or the step without PDL, must measure to be chosen
(below it: noise; the fused ops launch fewer kernels, and PDL is what the kernels' own
measurements ran with)."""

PREFERENCE = ((False, True), (True, True), (False, False), (True, False))
"""The variants as (unfused, PDL), the most preferred first: the fused layers with PDL,
then the layers unfused, then PDL off. Of the variants within ``MARGIN`` of the fastest,
the most preferred runs: a reading within noise of another buys no less preferred launch.
(On an H200 the 8 B shape's one-row step read 4412 µs unfused without PDL against 4426
with it, 0.3% apart, and the plan took PDL off; in the same run the decode benchmark found
the same layers with PDL 2.4% faster, 4.438 against 4.544 ms:
``benchmarks/results/tp_step_kernels_h200x2/call3/rules_tp_llama-8b_tp1_h200.json``.)"""

CHOICE_RULE = "preference within the margin"
"""Part of a stored plan's key: a plan chosen by an earlier rule is measured again."""

StepTimer = Callable[[int, bool, bool], float]
"""``(rows, unfused, pdl) -> µs`` of one decode step of ``rows`` rows, the layers fused or
not, its kernels launched with PDL where they ask for it or without."""


@dataclass(frozen=True)
class LayerTiming:
    """One captured size's decode step with the layers fused and unfused, each with PDL and
    without it (None: not timed, the kernels launch without PDL at this size anyway); µs,
    the slowest rank's."""

    rows: int
    fused_us: float
    unfused_us: float
    fused_no_pdl_us: float | None = None
    unfused_no_pdl_us: float | None = None

    @property
    def chosen(self) -> tuple[bool, bool]:
        """(unfused, PDL) of this size's steps: of the variants faster than the fused
        layers with PDL (fewer kernels, and the launches the GEMM plans were timed with)
        by ``MARGIN``, the most preferred (``PREFERENCE``) within ``MARGIN`` of the
        fastest; the fused layers with PDL where none is."""
        times = {
            (False, True): self.fused_us,
            (True, True): self.unfused_us,
            (False, False): self.fused_no_pdl_us,
            (True, False): self.unfused_no_pdl_us,
        }
        faster = {
            variant: us
            for variant, us in times.items()
            if us is not None and us * (1 + MARGIN) <= self.fused_us
        }
        if not faster:
            return (False, True)
        near = min(faster.values()) * (1 + MARGIN)
        return next(v for v in PREFERENCE if v in faster and faster[v] <= near)

    @property
    def unfused_wins(self) -> bool:
        """Whether this size runs the layers unfused."""
        return self.chosen[0]

    @property
    def no_pdl_wins(self) -> bool:
        """Whether this size steps without PDL."""
        return not self.chosen[1]


def plan_layers(
    model: DecoderModel,
    rows: Sequence[int],
    timer: StepTimer,
    cache: CompileCache | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[LayerTiming]:
    """Sets ``model.unfused_rows`` and ``model.no_pdl_rows`` to the sizes of ``rows``
    (those of at most ``MAX_ROWS``) whose fastest variant as ``timer`` found it
    (``LayerTiming.chosen``) runs the layers unfused, or without PDL; or both to what
    ``cache`` holds for this model. Returns the timings (empty where nothing was
    measured). Collective over ``group`` where one is given."""
    model.unfused_rows = model.no_pdl_rows = frozenset()
    sizes = _sizes(model, rows)
    if not sizes:
        return []
    keys = _cache_keys(model, sizes, cache)
    stored = cache.load_plans() if cache is not None else {}
    if every_rank(keys is not None and all(k in stored for k in keys), group):
        assert keys is not None  # (found in the cache)
        model.unfused_rows, model.no_pdl_rows = (frozenset(stored[k]) for k in keys)
        return []
    times = largest_over_group(
        [[timer(r, False, True), timer(r, True, True)] for r in sizes], group
    )
    timings = [LayerTiming(r, f, u) for r, (f, u) in zip(sizes, times, strict=True)]
    timings = _without_pdl(model, timings, timer, group)
    model.unfused_rows = frozenset(t.rows for t in timings if t.unfused_wins)
    model.no_pdl_rows = frozenset(t.rows for t in timings if t.no_pdl_wins)
    logger.info(
        "ostinato: fused layers measured slower at rows %s: unfused there; PDL slower at rows "
        "%s: off there", sorted(model.unfused_rows), sorted(model.no_pdl_rows),
    )  # fmt: skip
    store_layer_plan(model, sizes, cache)
    return timings


def _without_pdl(
    model: DecoderModel,
    timings: list[LayerTiming],
    timer: StepTimer,
    group: dist.ProcessGroup | None,
) -> list[LayerTiming]:
    """``timings`` with each size's layers timed fused and unfused without PDL too, where
    its kernels would launch with it (``KernelOptions.pdl``, ``LaunchRules.pdl_max_rows``):
    each pair, since the layering that wins with PDL need not win without it."""
    on = [t.rows for t in timings if pdl_for(model.kernels.pdl, t.rows)]
    times = largest_over_group([[timer(r, False, False), timer(r, True, False)] for r in on], group)
    off = dict(zip(on, times, strict=True))
    return [
        replace(t, fused_no_pdl_us=off[t.rows][0], unfused_no_pdl_us=off[t.rows][1])
        if t.rows in off
        else t
        for t in timings
    ]


def store_layer_plan(model: DecoderModel, rows: Sequence[int], cache: CompileCache | None) -> None:
    """Stores ``model.unfused_rows`` and ``model.no_pdl_rows`` as the layer plan over
    ``rows``, under the key ``plan_layers`` reads for the model's GEMM plans as they are
    now (a plan changed after its measurement: ``KernelPlan.keep_rules_at``)."""
    sizes = _sizes(model, rows)
    keys = _cache_keys(model, sizes, cache) if sizes else None
    if cache is not None and keys is not None:
        chosen = (model.unfused_rows, model.no_pdl_rows)
        cache.store_plans(
            {k: sorted(r for r in c if r in sizes) for k, c in zip(keys, chosen, strict=True)}
        )


def layer_plan_cached(model: DecoderModel, rows: Sequence[int], cache: CompileCache | None) -> bool:
    """Whether ``plan_layers`` with these arguments would measure nothing (its plan is
    in ``cache``, or there is nothing to plan), for the GEMM plans ``model`` has now.
    Reads only; one rank's answer."""
    sizes = _sizes(model, rows)
    if not sizes:
        return True
    keys = _cache_keys(model, sizes, cache)
    if keys is None or cache is None:
        return False
    stored = cache.load_plans()  # (once: a file read)
    return all(k in stored for k in keys)


def _sizes(model: DecoderModel, rows: Sequence[int]) -> list[int]:
    """The sizes a layer plan covers: those of ``rows`` the fused ops take (none without
    them)."""
    return sorted({r for r in rows if r <= MAX_ROWS}) if model.kernels.fused_layers else []


def _cache_keys(
    model: DecoderModel, sizes: list[int], cache: CompileCache | None
) -> tuple[str, str] | None:
    """The keys of the sizes run unfused and of those run without PDL (a plan is read
    only where both are stored: an earlier start's, before PDL was measured, has the
    first alone)."""
    if cache is None:
        return None
    device, key = model.embed_tokens.weight.device, layer_key(model)
    return cache.plan_key(device, key, sizes, "layers"), cache.plan_key(
        device, key, sizes, "no pdl"
    )


def layer_key(model: DecoderModel) -> list[object]:
    """What a layer plan depends on besides the device and the sizes: the model's shape
    and dtype, the tensor-parallel size, the launch options, the attention backend's
    placement of RoPE, the projections' GEMM plans (set before this is measured) and the
    rule that chose from the timings (``CHOICE_RULE``)."""
    c, w = model.config, model.embed_tokens.weight
    plans = repr([linear.plan for linear, _ in model.linears()]).encode()
    # compile_ahead only moves compile time: a plan measured with it holds without it.
    kernels = replace(model.kernels, compile_ahead=False)
    return [
        c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
        c.vocab_size, w.dtype, model.tp.size, kernels, model.rope_in_attention,
        hashlib.sha256(plans).hexdigest()[:16], CHOICE_RULE,
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
    capture). With ``rows_ahead`` (``KernelOptions.compile_ahead``), the first call with
    PDL (and again the first without) first queues that eager step for each of those
    sizes (at most ``MAX_ROWS``), fused and unfused, inside ``launch.compile_ahead()``:
    the layers' kernels of every variant the timings launch compile together (processes
    or threads), not one after another. The variant is this thread's alone
    (``DecoderModel.unfused_here``, ``launch.without_pdl``). A background
    measurement (``turn()``: its hold of the device between steps) holds the turn for
    each timed replay apart (``held_replays_us``: the median), so no step's work is
    timed with it; the eager step, whose kernels queue behind the steps' on the stream
    they share (the projections' split-K counters are used by one kernel at a time), the
    capture, which runs nothing, and the compile-ahead pass, which launches nothing, hold
    none. ``input_ids``, ``positions`` and what ``context`` writes must then be the
    measurement's own."""
    ahead = {pdl: sorted({r for r in rows_ahead if r <= MAX_ROWS}) for pdl in (True, False)}

    @contextlib.contextmanager
    def variant(rows: int, unfused: bool, pdl: bool) -> Iterator[None]:
        with model.unfused_here(frozenset({rows}) if unfused else frozenset()):
            with without_pdl(not pdl):
                yield

    def eager(rows: int) -> Callable[[], torch.Tensor]:
        ids, pos = input_ids[:rows], positions[:rows]
        step = lambda: model.logits(ids, pos)  # noqa: E731
        step()
        return step

    def step_us(rows: int, unfused: bool, pdl: bool) -> float:
        if ahead[pdl]:
            with compile_ahead():
                for r in ahead[pdl]:
                    for u in (False, True):
                        with variant(r, u, pdl), context(r), torch.cuda.device(input_ids.device):
                            eager(r)
            ahead[pdl].clear()
        with variant(rows, unfused, pdl), torch.cuda.device(input_ids.device), context(rows):
            step = eager(rows)
            graph = captured_calls(step, steps)
            return held_replays_us(graph, replays, turn) / steps

    return step_us
