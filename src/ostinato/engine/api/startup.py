"""Building an ``Engine`` from ``EngineArgs``: check every option, open the model, join the
process group, plan the memory, load the weights, make the KV cache, the runner, the
scheduler and the sampler, compile and capture. Each phase is one function; ``build``
runs them in order and times them (``StartupTimes``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ostinato.config import DEFAULT_MAX_CAPTURE_SIZE, GraphConfig
from ostinato.distributed.all_reduce_plan import parse_all_reduce
from ostinato.distributed.collectives import every_rank
from ostinato.distributed.failure import RankFailure
from ostinato.distributed.groups import (
    ParallelConfig,
    ParallelGroups,
    TensorParallel,
    init_parallel,
)
from ostinato.distributed.symm_all_reduce import SymmetricAllReduce, setup_symmetric_all_reduce
from ostinato.engine.api.arguments import (
    auto_capture,
    check_capture,
    check_lora,
    engine_limits,
    limit_cpu_threads,
    micro_batching_policy,
    parse_speculative,
    refuse_ignored,
    resolve_dtype,
)
from ostinato.engine.api.engine import EngineParts, StartupTimes
from ostinato.engine.api.engine_args import (
    LADDER_TOP,
    EngineArgs,
    LoraArgs,
    lora_module,
    parse_mode,
    resolve_device,
)
from ostinato.engine.api.lora_registry import LoraRegistry
from ostinato.engine.api.prompts import decode_text
from ostinato.engine.core.heap import freeze_heap, quiet_start
from ostinato.engine.core.kv_cache import BlockPool, KVCache
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.lora_slots import LoraSlots
from ostinato.engine.core.scheduler import Proposal, Scheduler
from ostinato.engine.core.stop_text import Decode
from ostinato.engine.kernels.options import KernelOptions
from ostinato.engine.loading.model_cache import ModelCache
from ostinato.engine.loading.source import ModelSource, open_model
from ostinato.engine.model.all_reduce_norm_op import (
    LADDER,
    PROTOCOL,
    FusedReduceNorm,
    setup_fused_reduce_norm,
)
from ostinato.engine.model.attention import AttentionBackend
from ostinato.engine.model.backends import default_backend
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.model.lora import LoraShape
from ostinato.engine.sample.adjust import OutputCounts
from ostinato.engine.sample.step_sampler import StepSampler
from ostinato.engine.spec.self_draft import SelfDraftProposer
from ostinato.engine.spec.speculative import NgramProposer, SpeculativeConfig
from ostinato.engine.worker import sampling_graphs
from ostinato.engine.worker.compile_cache import CompileCache
from ostinato.engine.worker.memory import (
    MemoryPlan,
    check_graph_memory,
    check_utilization,
    plan_memory,
)
from ostinato.engine.worker.runner import ModelRunner
from ostinato.engine.worker.sampling_graphs import SamplingGraphs
from ostinato.modes import GraphMode
from ostinato.platform import exclusive_device, platform_for_device
from ostinato.platform.base import Held, isolated_capture
from ostinato.resolution import AttentionGraphSupport
from ostinato.runtime import choose_compiler
from ostinato.ubatch.policy import MicroBatching

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checked:
    """What the options resolve to before anything large happens: every value checked,
    so a bad one is refused before the model is opened."""

    args: EngineArgs
    device: torch.device
    parallel: ParallelConfig
    mode: GraphMode | None
    speculative: SpeculativeConfig | None
    capture: str  # GraphArgs.capture, checked
    utilization: float
    micro_batching: MicroBatching | None
    lora: LoraArgs  # checked
    kernels: KernelOptions  # args.kernels resolved for the device (KernelOptions.resolved)

    def lora_shape(self, limits: EngineLimits) -> LoraShape | None:
        """The LoRA slots the model holds (None without ``enable_lora``)."""
        lora = self.lora
        if not lora.enable_lora:
            return None
        return LoraShape(lora.max_loras, lora.max_lora_rank, limits.max_num_batched_tokens)


def check_args(args: EngineArgs) -> Checked:
    """Checks every option of ``args`` (``ValueError`` / ``TypeError`` naming it); limits
    the CPU threads of a CPU engine."""
    device = resolve_device(args.device)
    resolve_dtype(args.dtype, device)  # refuse a bad dtype before loading anything
    parallel = args.parallel
    config = ParallelConfig(parallel.tensor_parallel_size, parallel.data_parallel_size)
    parse_all_reduce(parallel.all_reduce)
    speculative = parse_speculative(args.speculative, args.num_speculative_tokens)
    requested = parse_mode(args.graphs.mode)
    refuse_ignored(args, device)
    capture = check_capture(args.graphs, parallel, speculative, requested)
    if capture in ("staged", "background") and not platform_for_device(device).supports_graphs:
        what = "upgrades graphs" if capture == "staged" else "captures graphs on a thread"
        raise ValueError(
            f"capture={capture!r}: {what}, which {device.type} has none of; "
            "use capture='blocking' (or 'auto')"
        )
    if not isinstance(args.kernels, KernelOptions):
        raise TypeError(f"kernels: expected a KernelOptions, got {type(args.kernels).__name__}")
    kernels = args.kernels.resolved(device)  # (an option the device lacks is refused here)
    mode = engine_mode(requested, capture, device, args)
    if capture == "auto":
        graphs_here = platform_for_device(device).supports_graphs
        capture = auto_capture(args.graphs, parallel, speculative, mode, graphs_here)
    utilization = check_utilization(args.cache.gpu_memory_utilization)
    micro_batching = micro_batching_policy(parallel, mode)
    lora = check_lora(args.lora, parallel, speculative, capture)
    if device.type == "cpu":
        limit_cpu_threads(config.world_size)
    return Checked(
        args, device, config, mode, speculative, capture, utilization, micro_batching, lora,
        kernels,
    )  # fmt: skip


def engine_mode(
    requested: GraphMode | None, capture: str, device: torch.device, args: EngineArgs
) -> GraphMode | None:
    """The mode the engine runs: ``requested``, or for ``"auto"`` (None) the one measured
    fastest (benchmarks/RESULTS.md, start-up and e2e on an H200): FULL graphs of the
    model's own kernels wherever its attention can be captured whole on a platform with
    graphs. They decode as fast as FULL_AND_PIECEWISE's compiled pieces, prefill faster,
    and are ready without a compile. A staged start keeps "auto" (its upgrade's mode:
    FULL_AND_PIECEWISE); so does attention that cannot be captured whole (its pieces
    are compiled around it)."""
    if requested is not None or capture == "staged":
        return requested
    if not platform_for_device(device).supports_graphs:
        return None
    backend = args.backend or default_backend(device, args.kernels)
    whole = backend.graph_support is AttentionGraphSupport.ALWAYS
    return GraphMode.FULL if whole else None


def open_source(c: Checked) -> tuple[ModelSource, CompileCache | None, EngineLimits]:
    """The model's source (config, tokenizer, weights to load), the compile cache, and the
    engine's limits for it; a size tensor parallelism does not divide is named here."""
    model_cache = ModelCache.from_arg(c.args.cache_dir)
    compile_cache = model_cache and CompileCache(model_cache.root)
    if compile_cache is not None:
        compile_cache.point_compilers_here()  # before anything compiles
    source = open_model(
        c.args.model,
        c.args.random_weights,
        model_cache,
        resolve_dtype(c.args.dtype, c.device, torch.float32),  # a converted source's dtype
        later=True,  # a conversion's tokenizer beside the start: ``build`` waits for it
    )
    tp = c.parallel.tensor_parallel_size
    if tp > 1:  # (one rank divides every size; the real build would name any other error)
        with torch.device("meta"):  # names a size tp does not divide, before anything starts
            DecoderModel(source.config, TensorParallel(0, tp))
    return source, compile_cache, engine_limits(c.args.cache, source.config)


def capture_limit(asked: int | None, mode: GraphMode | None, limits: EngineLimits) -> int:
    """The ladder's largest size: as asked; by default a step's token budget, at most
    ``LADDER_TOP``, so that a mixed step replays a graph (on an H200, 64 streams of the
    1.5 B shape were served 23% faster than with the ladder ending at 512 and larger steps
    eager, whose launches cost 9-10 ms of host time, 14-18 at a token count not seen
    before); 512 for FULL_DECODE_ONLY, whose graphs serve decode steps only."""
    if asked is not None:
        return asked
    if mode is GraphMode.FULL_DECODE_ONLY:
        return DEFAULT_MAX_CAPTURE_SIZE
    return min(limits.max_num_batched_tokens, LADDER_TOP)


def graph_config(c: Checked, limits: EngineLimits, upgrade: bool = False) -> GraphConfig:
    """The graphs' configuration: the mode asked for and the capture ladder; with staged
    capture, FULL graphs of the eager model first, the mode asked for as the upgrade."""
    graphs = c.args.graphs
    first = c.capture == "staged" and not upgrade
    return GraphConfig(
        mode=GraphMode.FULL if first else c.mode,
        capture_sizes=graphs.capture_sizes,
        max_capture_size=(
            capture_limit(graphs.max_capture_size, c.mode, limits)
            if graphs.capture_sizes is None  # (``refuse_ignored``: one of the two)
            else None
        ),
        max_num_tokens=limits.max_num_batched_tokens,
        specialize_lora=c.lora.enable_lora and c.lora.specialize_lora,
        verify=graphs.verify,
        verify_every=graphs.verify_every,
    )


def setup_all_reduce(
    parallel: ParallelGroups,
    choice: str,
    hidden: int,
    dtype: torch.dtype,
    limits: EngineLimits,
    cache: CompileCache | None = None,
) -> tuple[ParallelGroups, SymmetricAllReduce | None, FusedReduceNorm | None]:
    """The symmetric-memory all-reduce asked for (None: NCCL alone, or no tensor
    parallelism), the groups that name it, and with ``"auto"`` the all-reduce fused with
    the norm after it where it measured faster (``fused_reduce_norm``)."""
    tp = parallel.tp
    if tp.group is None:
        return parallel, None, None
    if parallel.device.type != "cuda":
        if choice in ("one-shot", "two-shot"):
            raise ValueError(
                f"all_reduce={choice!r}: symmetric memory needs CUDA; this run is on "
                f"{parallel.device.type}; use 'auto' or 'nccl'"
            )
        return parallel, None, None
    max_bytes = limits.max_num_batched_tokens * hidden * dtype.itemsize
    reducer = setup_symmetric_all_reduce(tp.group, parallel.device, dtype, choice, max_bytes)
    if reducer is None:
        return parallel, None, None
    parallel = replace(parallel, tp=replace(tp, symmetric_group=reducer.group_name))
    if choice != "auto":
        return parallel, reducer, None
    return parallel, reducer, fused_reduce_norm(reducer, parallel.device, hidden, cache)


def fused_reduce_norm(
    reducer: SymmetricAllReduce, device: torch.device, hidden: int, cache: CompileCache | None
) -> FusedReduceNorm | None:
    """``setup_fused_reduce_norm`` for ``reducer``'s group, its row count read from
    ``cache`` beside the kernel plans where every rank finds it there (keyed by the
    device, the dtype, the width, the group's size and ``reducer``'s plan, which the
    two ops it is timed against follow), else measured and kept there."""
    group = reducer.group
    shape = [reducer.dtype, hidden, group.size(), reducer.plan.describe()]
    kind = f"all_reduce_norm/{PROTOCOL}"  # (another protocol's rows are measured anew)
    key = cache.plan_key(device, shape, LADDER, kind) if cache else None
    stored = cache.load_plans() if cache is not None else {}
    found = key is not None and key in stored
    rows = stored[key][0] if every_rank(found, group) and key is not None else None
    fused = setup_fused_reduce_norm(group, device, reducer.dtype, hidden, rows)
    if cache is not None and key is not None and rows is None:
        cache.store_plans({key: [fused.max_rows if fused is not None else 0]})
    return fused


def memory_plan(
    parts: EngineParts, c: Checked, limits: EngineLimits, graphs: GraphConfig
) -> MemoryPlan | None:
    """The KV cache's size from free device memory (None on the CPU)."""
    platform = platform_for_device(parts.device)
    platform.empty_cache()  # memory this process cached but does not use is free
    info = platform.device_memory()
    if info is None:
        return None
    free, total = info
    plan = plan_memory(
        parts.config,
        parts.dtype,
        limits,
        free=free,
        total=total,
        utilization=c.utilization,
        max_capture_tokens=0 if graphs.mode is GraphMode.NONE else graphs.largest_size,
        num_blocks=c.args.cache.num_blocks,
        tp=parts.parallel.tp,
        decode_query_len=1 + c.speculative.k if c.speculative else 1,
        upgrade_tokens=graphs.largest_size if c.capture == "staged" else 0,
        lora=c.lora_shape(limits),
    )
    logger.info("ostinato: memory plan: %s", plan.summary())
    return plan


def load_weights(
    parts: EngineParts,
    source: ModelSource,
    seed: int,
    limits: EngineLimits,
    lora: LoraShape | None = None,
) -> float:
    """Makes the model on the device (with ``lora``'s empty slots) and loads (or draws)
    its weights; seconds. Random weights come from a generator of their own, seeded with
    ``seed``: torch's default one is left as it was, and a graph another thread is capturing
    (which holds the default generator) cannot fail the draw."""
    start = time.perf_counter()
    # Weights are made in place on the device, in their dtype: no CPU copy, no float32
    # detour.
    with torch.device("meta"):
        kernels = parts.kernels  # (resolved by check_args)
        model = DecoderModel(parts.config, parts.parallel.tp, kernels, limits.max_model_len, lora)
    # Unwritten memory on the device, as Module.to_empty makes it, but through
    # torch.empty: to_empty's empty_like of a meta tensor runs torch's Python references,
    # whose first use imports sympy and the symbolic-shapes module (0.4 s of a start that
    # compiles nothing).
    device = parts.device
    model = model.to(parts.dtype)._apply(
        lambda t: torch.empty(t.shape, dtype=t.dtype, device=device)
    )
    if model.lora is not None:
        model.lora.clear()  # (left unwritten)
    if source.load is None:
        # Asked for (a preset, a config, or random_weights=True), so not a warning.
        logger.info("ostinato: %s: random weights (seed %d)", source.name, seed)
        # Drawn on the device: a seed gives one model per device type.
        model.reset_parameters(torch.Generator(device=device).manual_seed(seed))
    else:
        source.load(model)
    parts.model = model.eval()
    if parts.device.type == "cuda":
        torch.cuda.synchronize(parts.device)
    return time.perf_counter() - start


def make_proposer(
    parts: EngineParts, backend: AttentionBackend, limits: EngineLimits
) -> Proposal | None:
    """The speculative proposer asked for (None without speculation)."""
    spec = parts.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_max)
    if spec.method == "custom":
        return spec.proposer
    return SelfDraftProposer(
        parts.model,
        parts.cache,
        backend,
        limits,
        parts.device,
        spec.draft_layers,
        spec.k,
        pool=parts.runner.manager.pool,
        graphs=spec.draft_graphs,
    )


def make_runner(
    parts: EngineParts, c: Checked, limits: EngineLimits, graphs: GraphConfig, num_blocks: int
) -> Proposal | None:
    """The KV cache, the runner and the scheduler on ``parts``; returns the proposer."""
    config, spec = parts.config, parts.speculative
    parts.cache = KVCache(
        config.num_layers,
        num_blocks,
        limits.block_size,
        config.num_kv_heads // parts.parallel.tp.size,
        config.head_dim,
        parts.dtype,
        parts.device,
    )
    backend = c.args.backend or default_backend(parts.device, parts.model.kernels)
    # A staged start compiles nothing for its first stage: its upgrade does (``capture``).
    compiler = None
    if c.capture != "staged":
        platform = platform_for_device(parts.device)
        compiler = choose_compiler(c.args.graphs.compiler, graphs.mode, platform)
    parts.runner = ModelRunner(
        parts.model,
        parts.cache,
        backend,
        limits,
        graphs,
        parts.device,
        progress=c.args.progress,
        compiler=compiler,
        uniform_decode_query_len=1 + spec.k if spec else 1,
        micro_batching=c.micro_batching,
        compile_cache=parts.compile_cache,
    )
    propose = make_proposer(parts, backend, limits)
    parts.scheduler = Scheduler(
        BlockPool(num_blocks),
        limits,
        parts.eos_token_ids,
        propose=propose,
        num_speculative=spec.k if spec else 0,
        decode=_decoder(parts),
        lora_slots=LoraSlots(c.lora.max_loras) if c.lora.enable_lora else None,
    )
    return propose


def lora_registry(parts: EngineParts, c: Checked) -> LoraRegistry | None:
    """The engine's adapters, ``lora_modules`` loaded (None without ``enable_lora``)."""
    slots = parts.scheduler.lora_slots
    if parts.model is None or parts.model.lora is None or slots is None:
        return None
    registry = LoraRegistry(parts.model.lora, parts.config, slots)
    for name, path in map(lora_module, c.lora.lora_modules):
        registry.load(name, path)
    return registry


def _decoder(parts: EngineParts) -> Decode | None:
    """Token ids to text with the model's tokenizer (None without one): the stop
    strings' text. Read at each call: a converted model's arrives at the end of ``build``."""
    if parts.tokenizer is None and not parts.tokenizer_pending:
        return None
    return lambda ids: decode_text(parts.tokenizer, ids)


def capture(
    parts: EngineParts, c: Checked, propose: Proposal | None, limits: EngineLimits
) -> float:
    """Captures the runner's graphs, the sampling graphs and the draft graphs (or starts
    the background capture, or after the first stage the staged upgrade), and makes the
    sampler; returns the seconds the sampling graphs took (in the background: none
    here, they are captured on its thread after the step graphs)."""
    generator = torch.Generator(device=parts.device).manual_seed(c.args.seed)
    runner = parts.runner
    vocab = runner.model.config.vocab_size
    counts = OutputCounts(vocab, limits.max_num_seqs, parts.device)
    parts.sampler = StepSampler(generator, parts.device, counts)
    sampling_s = 0.0
    if c.capture == "background":

        def on_thread(unit: Held) -> None:
            # Outside inference mode, which the capture thread runs in: the steps write
            # the sampling graphs' inputs in place, from a thread that is not in it.
            with torch.inference_mode(False):
                # Made and prepared beside the steps, which do not see them yet: a step
                # waiting for the turn would otherwise wait out the compile (or the first
                # runs' lazy set-up).
                made = sampling_graphs.make(runner, generator, counts)
                sampling_graphs.prepare(runner, made)
                _finish(parts, generator, made, unit)

        def first() -> None:  # (while the steps still run eagerly)
            sampling_graphs.load_kernels(runner)

        # The sampling graphs read the step graphs' static outputs: captured after them,
        # on the thread, a size per hold of the step turn; until its size is captured a
        # step samples eagerly.
        parts.background = runner.capture_in_background(on_thread, first)
    else:
        runner.capture()
        start = time.perf_counter()
        _finish(parts, generator)
        sampling_s = time.perf_counter() - start
    if c.capture == "staged":
        upgrade = graph_config(c, limits, upgrade=True)
        platform = platform_for_device(parts.device)
        compiler = choose_compiler(c.args.graphs.compiler, upgrade.mode, platform)
        budget = parts.memory.upgrade if parts.memory is not None else None
        parts.background = runner.start_upgrade(upgrade, compiler or "inductor", budget)
    parts.capture_report = runner.manager.report
    if isinstance(propose, SelfDraftProposer):
        parts.drafter = propose
        # The k-step draft loop, one graph per batch size, in the same pool; every rank
        # captures them in the same order (they hold the LM head's all-gather).
        parts.draft_report = propose.capture()
    return sampling_s


def _finish(
    parts: EngineParts,
    generator: torch.Generator,
    made: SamplingGraphs = None,
    unit: Held | None = None,
) -> None:
    """The end of a capture (blocking, or on the background thread, each size inside a
    ``unit()`` of the step turn): the sampling graphs (``made`` earlier, or made now),
    handed to the sampler, and the graph memory checked against the reserve that sized
    the KV cache (logged; ``describe`` shows it)."""
    sampler = parts.sampler
    graphs = sampling_graphs.capture(parts.runner, generator, sampler.counts, made, unit)
    sampler.graph_sampler = graphs
    if parts.memory is not None:
        pool = parts.runner.manager.report.pool_bytes
        parts.graph_memory = check_graph_memory(parts.memory, pool)


def build(
    c: Checked,
    launch: dict[str, str] | None,
    health: Callable[[], RankFailure | None] | None,
    joined: Callable[[ParallelGroups], None],
) -> EngineParts:
    """The parts of the engine ``c`` asks for, on this rank (``launch``: the process
    group's environment when this process started the other ranks; ``health``: how to
    ask about them while joining; ``joined``: told the groups once joined, so a failure
    after it can be blamed on the peer that caused it). If anything fails, everything
    allocated is released before the error propagates. No collection runs while it makes
    the parts, up to its graphs' capture; what it made is left frozen (``heap``)."""
    with contextlib.ExitStack() as quiet:  # (closed by ``_build_on`` before the capture)
        quiet.enter_context(quiet_start())
        return _build_parts(c, launch, health, joined, quiet)


def _build_parts(
    c: Checked,
    launch: dict[str, str] | None,
    health: Callable[[], RankFailure | None] | None,
    joined: Callable[[ParallelGroups], None],
    quiet: contextlib.ExitStack,
) -> EngineParts:
    start = time.perf_counter()
    source, compile_cache, limits = open_source(c)
    parts = EngineParts(
        args=c.args,
        device=c.device,
        dtype=resolve_dtype(c.args.dtype, c.device, source.dtype),
        config=source.config,
        tokenizer=source.tokenizer,
        tokenizer_pending=source.pending is not None,
        source_name=source.name,
        eos_token_ids=source.eos_token_ids,
        kernels=c.kernels,
        speculative=c.speculative,
        compile_cache=compile_cache,
    )
    open_s = time.perf_counter() - start
    try:
        parts.parallel = init_parallel(c.parallel, c.device.type, launch_env=launch, health=health)
        joined(parts.parallel)
        # A conversion's entry is written on a thread beside the start (and its tokenizer
        # built there too where the child process failed): captures until then forbid
        # unsafe calls on their own thread only (CUDA's thread-local mode).
        isolated = isolated_capture() if source.pending else contextlib.nullcontext()
        with exclusive_device(), isolated:  # (exclusive: its docstring)
            _build_on(parts, c, source, limits, open_s, quiet)
        parts.tokenizer, parts.tokenizer_pending = source.finish(), False
        # What the blocking capture and the tokenizer made too; under the device gate,
        # because a background thread may be capturing: a collection's finalizers (a
        # tensor's, a graph's) must not run inside a capture in progress.
        with exclusive_device():
            freeze_heap()
    except BaseException:
        parts.release()
        raise
    return parts


def _build_on(
    parts: EngineParts,
    c: Checked,
    source: ModelSource,
    limits: EngineLimits,
    open_s: float,
    quiet: contextlib.ExitStack,
) -> None:
    if parts.parallel.world_size > 1:
        parts.device = parts.parallel.device
    parts.parallel, parts.all_reduce, parts.all_reduce_norm = setup_all_reduce(
        parts.parallel, c.args.parallel.all_reduce, parts.config.hidden_size, parts.dtype, limits,
        parts.compile_cache,
    )  # fmt: skip
    graphs = graph_config(c, limits)
    parts.memory = memory_plan(parts, c, limits, graphs)
    num_blocks = parts.memory.num_blocks if parts.memory else c.args.cache.num_blocks
    weights_s = load_weights(parts, source, c.args.seed, limits, c.lora_shape(limits))
    propose = make_runner(parts, c, limits, graphs, num_blocks or limits.full_blocks)
    parts.adapters = lora_registry(parts, c)
    capture_start = time.perf_counter()
    # The quiet start ends (one collection, the heap frozen) before any capture: a
    # background capture thread's collections then skip the heap, and its captures
    # pause and resume the collector themselves (``heap.quiet_start``).
    quiet.close()
    sampling_s = capture(parts, c, propose, limits)
    # A background capture compiles on its thread: none of that is this call's.
    compile_s = 0.0 if c.capture == "background" else parts.runner.compile_seconds
    parts.startup = StartupTimes(
        open_s,
        weights_s,
        compile_s,
        time.perf_counter() - capture_start - compile_s,
        # (a staged start's first stage is captured here, blocking: its line names it)
        background=c.capture == "background",
        recording_s=parts.runner.manager.report.seconds,
        sampling_s=sampling_s,
        kernels_s=max(0.0, parts.runner.prepare_seconds - compile_s),
        gemm_plan_s=parts.runner.kernel_plan.gemm_seconds,
        layer_plan_s=parts.runner.kernel_plan.layer_seconds,
        plans_deferred=parts.runner.kernel_plan.started_deferred,
    )
