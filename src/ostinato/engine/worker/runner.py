"""ModelRunner: a model over its persistent inputs, with graphs from the one entry point."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ostinato.background import BackgroundCapture, InUnits
from ostinato.batch import BatchDescriptor
from ostinato.capture_report import CaptureReport
from ostinato.config import GraphConfig
from ostinato.context import current_forward_context, forward_context
from ostinato.dispatcher import Dispatch
from ostinato.distributed.agreement import StepAgreement
from ostinato.engine.core.heap import IdleFreeze
from ostinato.engine.core.kv_cache import KVCache
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.scheduler import ScheduledBatch
from ostinato.engine.kernels.gemm_launch import MAX_ROWS
from ostinato.engine.kernels.options import KernelOptions
from ostinato.engine.model.attention import AttentionBackend
from ostinato.engine.model.attention_op import StepAttention
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.sample.greedy import greedy_tokens
from ostinato.engine.sample.step_sampler import StepOutput
from ostinato.engine.worker.compile_cache import CompileCache
from ostinato.engine.worker.deferred_plans import DeferredPlans
from ostinato.engine.worker.gemm_tuning import GemmTiming
from ostinato.engine.worker.graph_upgrade import GraphUpgrade
from ostinato.engine.worker.inputs import PreviousSample, StepInputs
from ostinato.engine.worker.kernel_plan import Forward, KernelPlan
from ostinato.engine.worker.layer_tuning import StepTimer, graph_timer
from ostinato.engine.worker.ubatch_steps import UbatchSteps
from ostinato.manager import GraphManager
from ostinato.modes import GraphMode
from ostinato.piecewise import CompiledModel, PiecewiseBackend
from ostinato.platform import platform_for_device
from ostinato.platform.base import Held
from ostinato.resolution import ModeResolution
from ostinato.runtime import GraphRuntime, build_graph_runtime
from ostinato.staged import StagedRuntime
from ostinato.ubatch.policy import MicroBatching

# (input ids, positions, where to write them or None) -> logits
LogitsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class ModelRunner:
    """Runs one scheduled step of ``DecoderModel`` and returns the last-token logits.

    Guarantees: the step's inputs live in ``inputs`` (``StepInputs``: fixed addresses,
    one padding convention), so captured graphs replay on new data; graphs are wired by
    ``build_graph_runtime`` from ``graph_config`` and the attention backend's support;
    ``compiler`` (None, ``"inductor"`` or ``"eager"``) compiles the model with the
    piecewise backend, which makes piecewise modes available. The model's
    ``rope_in_attention`` is set from ``backend.applies_rope``. The model's
    ``KernelOptions`` (it is built with them; the attention backend with
    ``default_backend(device, kernels)``) decide the projections' plans: with
    ``small_gemm`` measured at start-up, before compiling (``gemm_timings``), or read
    from ``compile_cache``; with ``fused_layers`` given by rule to the small ones.
    """

    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        backend: AttentionBackend,
        limits: EngineLimits,
        graph_config: GraphConfig,
        device: torch.device,
        progress: bool = True,
        compiler: str | None = None,
        uniform_decode_query_len: int = 1,
        micro_batching: MicroBatching | None = None,
        compile_cache: CompileCache | None = None,
    ) -> None:
        self.model = model
        self.compile_cache = compile_cache
        # RoPE goes where the backend says: in the model, or inside the attention op.
        model.rope_in_attention = getattr(backend, "applies_rope", False)
        self.cache, self.backend, self.limits, self.device = cache, backend, limits, device
        lora_rows = model.lora.row_slots if model.lora is not None else None
        self.inputs = StepInputs(limits, device, lora_rows)
        self._scratch: StepInputs | None = None  # (``_warm_step``'s, made at its first call)
        platform = platform_for_device(device)
        self.graphs: GraphRuntime = build_graph_runtime(
            self._step,
            graph_config,
            attention=backend.graph_support,
            piecewise_available=compiler is not None,
            prepare=self.dummy_metadata,
            perturb_padding=self._scramble_padding,
            warm_step=self._warm_step,
            max_num_reqs=limits.max_num_seqs,
            uniform_decode_query_len=uniform_decode_query_len,
            lora_enabled=model.lora is not None,
            platform=platform,
            progress=progress,
        )
        # The model's own kernel options (it was built with them): what the compiled
        # pieces, the small-GEMM plans and compile-ahead follow here too. Off CUDA no
        # launch option reaches a kernel, so a model built with them runs as resolved.
        self.kernels = runner_kernels(model.kernels, device)
        self.kernel_plan = self._kernel_plan(graph_config.sizes, compile_cache)
        self.piecewise = self._piecewise(compiler, graph_config.check_addresses)
        self.forward: Forward = (
            model if self.piecewise is None else CompiledModel(model, self.piecewise)
        )
        self.ubatch = UbatchSteps(micro_batching, model, self.inputs, cache, backend, self.graphs)
        # The staged start's upgrade (``start_upgrade``), once started.
        self.staged: StagedRuntime | None = None
        self.upgrade: GraphUpgrade | None = None
        # FULL mode's decode logits, where its sampling graphs read them (None without).
        self.sample_logits: torch.Tensor | None = None
        # The capture's preparation: kernel plans, the kernels' compile (or load from
        # Triton's cache) ahead, the micro-batch measurement; seconds, set by ``capture``.
        self.prepare_seconds = 0.0
        # Plans deferred past the graphs are measured by this, on the capture thread.
        self.deferred_plans = DeferredPlans(self)
        # What a background start or an upgrade made is frozen once the engine is idle.
        self.idle_freeze = IdleFreeze()

    def _kernel_plan(
        self, sizes: tuple[int, ...], compile_cache: CompileCache | None
    ) -> KernelPlan:
        """The projections' plans of this runner's kernel options, every plan an earlier
        runner of the model left cleared first."""
        for linear, _ in self.model.linears():
            linear.use_plan((), 0, False)
        self.model.unfused_rows = self.model.no_pdl_rows = frozenset()
        # Row counts the small-GEMM plans cover: the captured sizes (graphs are where a
        # kernel's fixed cost shows); none in NONE mode. The fused layers are measured
        # against the unfused at the same sizes, where FULL graphs replay them on CUDA.
        graphs = self.graphs.mode is not GraphMode.NONE
        rows = sizes if self.kernels.small_gemm and graphs else ()
        measured = self.kernels.fused_layers and graphs and self.device.type == "cuda"
        timer = _layer_timer(self, sizes) if measured else None
        return KernelPlan(
            self.model, self.kernels, self.limits, rows, compile_cache, self._padding_context,
            timer, sizes,
        )  # fmt: skip

    def _piecewise(self, compiler: str | None, check_addresses: bool) -> PiecewiseBackend | None:
        """The backend that compiles the model's pieces (None without a compiler)."""
        if compiler is None:
            return None
        return PiecewiseBackend(
            compiler=compiler,
            check_addresses=check_addresses,
            platform=self.manager.platform,
            pool=self.manager.pool,
            # Inductor's kernels keep plain launches: its PDL switch holds at every size,
            # and PDL slowed steps of more than 16 rows (``pdl_for``).
            inductor_patches=None,
        )

    @property
    def compile_seconds(self) -> float:
        """Seconds the one-time compile took (0.0 before it, or with nothing to compile)."""
        return self.kernel_plan.compile_seconds

    @property
    def resolution(self) -> ModeResolution:
        """The graph mode in use and the reasons it differs from the one asked for."""
        return self.graphs.resolution

    @property
    def manager(self) -> GraphManager:
        """The graph manager (capture, replay)."""
        return self.graphs.manager

    def metadata(self, n: int, query_lens: list[int], seq_lens: list[int]) -> StepAttention:
        """The step's attention context over the first ``n`` rows of the persistent buffers
        (its new keys bounded by its longest query, or by ``n`` where none is given)."""
        new_keys = max(query_lens, default=n)
        return StepAttention(
            self.inputs.metadata(n, query_lens, seq_lens, new_keys), self.cache, self.backend
        )

    def dummy_metadata(self, d: BatchDescriptor, inputs: StepInputs | None = None) -> StepAttention:
        """The attention context a graph of ``d`` is captured with: padding rows (in
        ``inputs``, by default the steps' own), and a bound on the new keys that holds for
        every step it replays (a uniform decode's query length, else its row count)."""
        uniform = self.graphs.dispatcher.uniform_decode_query_len
        new_keys = uniform if d.uniform_decode else d.num_tokens
        return self._padding_metadata(inputs or self.inputs, d.num_tokens, new_keys)

    def _warm_step(self, d: BatchDescriptor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``_step`` of ``d``, eagerly, on padding rows of inputs of its own, which no step
        reads or writes (their K/V go to the null block): a background capture's
        warm-up, beside the steps."""
        if d in self.ubatch.graphs:  # (never: a background capture refuses micro-batching)
            raise RuntimeError(f"{d}: a micro-batched step has no warm-up on inputs apart")
        if self._scratch is None:
            self._scratch = StepInputs(self.limits, self.device)
        with forward_context(GraphMode.NONE, d, self.dummy_metadata(d, self._scratch)):
            return self.step_as(d, False, inputs=self._scratch)

    def _scramble_padding(self, d: BatchDescriptor, real: int) -> None:
        """The capture check's other padding: rows ``real..`` of a dummy step get other
        token ids, drawn the same on every rank (a graph whose first rows then change
        mixes rows)."""
        draw = torch.Generator().manual_seed(d.num_tokens)
        ids = torch.randint(1, self.model.config.vocab_size, (d.num_tokens - real,), generator=draw)
        self.inputs.input_ids[real : d.num_tokens].copy_(ids)

    def _padding_metadata(
        self, inputs: StepInputs, n: int, new_keys: int | None = None
    ) -> StepAttention:
        """``n`` padding rows written into ``inputs``, and their attention context (new
        keys bounded by ``new_keys``, by default ``n``: as a step of ``n`` rows, so eager
        passes launch the kernels the steps launch)."""
        inputs.write_padding(n)
        meta = inputs.metadata(n, [], [], n if new_keys is None else new_keys)
        return StepAttention(meta, self.cache, self.backend)

    def _step(self, d: BatchDescriptor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of the first ``d.num_tokens`` rows; for a uniform decode, where
        every row is one whose logits are needed, their logits and greedy tokens
        instead, so the decode graph covers the LM head (and its all-gather under TP) and
        greedy sampling. A descriptor in ``ubatched_graphs`` runs as two micro-batches
        over the two halves of its rows (its warm-up, capture and replays alike)."""
        return self.step_as(d, d in self.ubatch.graphs)

    def step_as(
        self,
        d: BatchDescriptor,
        ubatched: bool,
        mode: GraphMode | None = None,
        forward: Forward | None = None,
        inputs: StepInputs | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``_step`` of a stage whose graphs are in ``mode`` and whose compiled model is
        ``forward`` (default: this runner's own; ``GraphUpgrade`` passes its), on the rows
        of ``inputs`` (default: the steps' own)."""
        n = d.num_tokens
        inputs = inputs or self.inputs
        ids, positions = inputs.input_ids[:n], inputs.positions[:n]
        mode, forward = mode or self.graphs.mode, forward or self.forward
        measured = not ubatched and self._fused_eagerly(d, mode)  # (what layer_tuning times)
        with self.model.launches_at(n) if measured else contextlib.nullcontext():
            if not d.uniform_decode:
                if ubatched:
                    return self.ubatch.run_static(n)
                return self._forward_for(d, mode, forward)(ids, positions)
            logits_out, greedy_out = _static_rows()
            if ubatched:
                logits = self.model.compute_logits(self.ubatch.run_static(n), logits_out)
            else:
                logits = self._logits_for(d, mode, forward)(ids, positions, logits_out)
            return logits, greedy_tokens(logits, self.kernels.pdl, greedy_out)

    def _forward_for(self, d: BatchDescriptor, mode: GraphMode, forward: Forward) -> Forward:
        """What runs the model for a step of ``d``: the eager model where
        ``_fused_eagerly``; else ``forward``."""
        return self.model if self._fused_eagerly(d, mode) else forward

    def _logits_for(self, d: BatchDescriptor, mode: GraphMode, forward: Forward) -> LogitsFn:
        """What makes a uniform decode step's logits from its inputs (into ``out``
        where given and the LM head is cuBLAS's): where ``_forward_for`` names the eager
        model, its ``logits`` (the final norm inside the LM head's kernel where the LM
        head's plan runs the Triton GEMM); else the LM head after that forward."""
        forward = self._forward_for(d, mode, forward)
        if forward is self.model:
            return self.model.logits
        return lambda ids, positions, out: self.model.compute_logits(forward(ids, positions), out)

    def _fused_eagerly(self, d: BatchDescriptor, mode: GraphMode) -> bool:
        """Whether a step of ``d`` runs the eager model rather than the compiled one: with
        fused layers, where its runtime mode is FULL and its rows fit the fused kernels.
        Compiled, the layers run unfused (``DecoderLayer.forward``); a FULL graph of
        the eager model replays the fused kernels without their host cost."""
        runtime = mode.decode_mode() if d.uniform_decode else mode.mixed_mode()
        return self.kernels.fused_layers and runtime is GraphMode.FULL and d.num_tokens <= MAX_ROWS

    def run_logits(
        self,
        dispatch: Dispatch,
        n: int,
        meta: StepAttention,
        rows: torch.Tensor | slice,
        decode: bool = False,
    ) -> StepOutput:
        """Runs the step as dispatched: the logits of ``rows`` (for a uniform decode
        dispatch, all ``n`` rows, whose logits and argmax the step itself computed;
        ``decode``: the step is a uniform decode, whatever it was dispatched as)."""
        # Asked before the run, under the step's turn: a FULL dispatch whose graph is not
        # ready yet (background capture) runs eagerly, and its logits are no static output.
        # A step the staged upgrade runs (dispatched to it) is no replay of the first
        # stage's graphs, whose static outputs the sampling graphs read.
        upgraded = self.staged is not None and self.staged.routes(dispatch)
        replayed = not upgraded and dispatch.mode is GraphMode.FULL and self.manager.ready(dispatch)
        # An eager step while the start compiles: its kernels first, together.
        if not upgraded and not replayed and self.kernel_plan.steps_meanwhile:
            step = functools.partial(_eager_pass, self, dispatch, meta, rows)
            self.kernel_plan.compile_first(dispatch.descriptor, step)
        out = (self.staged or self.manager).run(dispatch, n, attn_metadata=meta)
        # A sampled check that found the replay wrong has just demoted it and returned
        # eager outputs, which are no static outputs either.
        replayed = replayed and self.manager.ready(dispatch)
        d = dispatch.descriptor
        if replayed and d in self.ubatch.graphs:
            self.ubatch.steps += 1
            self.ubatch.replays += 1
        if d.uniform_decode:
            logits, greedy = out
            size = d.num_tokens if replayed else None
            return StepOutput(logits, greedy, size)
        return self._decode_logits(out[rows], decode, d.num_tokens)

    def plan_kernels(self, defer: bool = False) -> list[GemmTiming]:
        """The projections' plans, set once before anything compiles (``KernelPlan``;
        ``defer``: the rules' plans where the cache lacks the measured ones)."""
        return self.kernel_plan.plan(defer)

    def compile(self) -> float:
        """Plans the kernels, then compiles the model (piecewise backend) once, at the
        largest size, and with ``compile_ahead`` the engine's Triton kernels first;
        seconds (0.0 when there was nothing left to compile)."""
        self.plan_kernels()
        return self._compile_on(self.inputs, self.forward)

    def _compile_on(self, inputs: StepInputs, forward: Forward) -> float:
        # (on the background thread too, beside another engine's captures)
        sync = self.manager.platform.synchronize_outside_capture
        seconds = self.kernel_plan.compile_on(inputs, forward, self.piecewise, sync)
        if seconds > 0.0:
            self.kernel_plan.compile_seconds = seconds
        return seconds

    def _padding_context(self, inputs: StepInputs, n: int) -> contextlib.AbstractContextManager:
        """An eager step's context over ``n`` padding rows of ``inputs``."""
        meta = self._padding_metadata(inputs, n)
        return forward_context(GraphMode.NONE, BatchDescriptor(n), meta)

    def capture(self) -> CaptureReport:
        """Compiles if needed, then captures every graph of the resolved mode. With a
        measuring micro-batching policy, the sizes to capture split are measured first
        (``UbatchSteps.choose``). Under tensor
        parallelism every rank captures (and times) the same descriptors in the same
        order, between two barriers, so the collectives recorded in the graphs pair up
        across ranks. Where a background start would defer its kernel plans (one GPU,
        graphs of the eager model, plans not in the cache), so does this one, and measures
        them after its graphs as that start does (``DeferredPlans``), before returning:
        each size keeps the faster of its graphs on the rules' kernels and on the measured
        plans, not the plans' per-GEMM timings alone."""
        group = self.model.tp.group
        if group is not None:
            dist.barrier(group=group)
        start = time.perf_counter()
        self.plan_kernels(defer=self._defers_plans())
        self.compile()  # (the plans are set: compiles what is left)
        self.ubatch.choose(self.step_as, self.dummy_metadata)
        self.prepare_seconds = time.perf_counter() - start
        report = self.manager.capture()
        if self.kernel_plan.deferred:
            self.deferred_plans(contextlib.nullcontext)  # (no steps to hand a turn to)
        if group is not None:
            dist.barrier(group=group)
        return report

    def _defers_plans(self) -> bool:
        """Whether this start's plans may be measured after its graphs: graphs of the eager
        model (compiled pieces cannot be captured again with other plans), one rank (the
        ranks would have to agree), no micro-batching policy measuring its captures."""
        single = self.model.tp.group is None and not self.ubatch.candidates
        return single and self.piecewise is None and self.graphs.mode is not GraphMode.NONE

    def capture_in_background(
        self,
        epilogue: InUnits | None = None,
        prologue: Callable[[], None] | None = None,
    ) -> BackgroundCapture:
        """What ``capture`` does, on a thread (``ostinato.background``): returns at once.
        The thread compiles first, on scratch inputs of its own; until it is done, steps
        run the uncompiled model (the same function; Inductor's fused kernels may round
        differently), then the compiled one, eagerly until their size's graph is ready;
        ``prologue`` runs on it before the first graph (after the compile, which the
        steps need first), without the step turn; ``epilogue`` once every graph is
        ready, holding the step turn inside each ``unit()`` it is given; then the plans
        deferred, if any; last, it asks for one collection and the heap frozen
        (``idle_freeze``: run by the engine once no request is running; as after a
        blocking start, what the thread made lives as long as the graphs).
        Not with tensor parallelism (every rank would have to capture in step) or a
        measuring micro-batching policy (it times captures)."""
        if self.model.tp.group is not None or self.ubatch.candidates:
            raise ValueError(
                "capture='background': not with tensor parallelism or micro-batching, whose "
                "graphs every rank captures in the same order; use capture='blocking'"
            )
        start = time.perf_counter()
        # Sets the projections' plans before any step runs. Graphs of the eager model
        # can be captured again with other plans, so where the cache lacks them they
        # are measured after the graphs (``DeferredPlans``); compiled pieces cannot.
        self.plan_kernels(defer=self._defers_plans())
        self.prepare_seconds = time.perf_counter() - start  # (the thread compiles)
        after = self.deferred_plans if self.kernel_plan.deferred else None
        compiled = self.forward
        if compiled is self.model and not self.kernel_plan.compiles_kernels:
            return self.manager.capture_in_background(
                prologue, epilogue, after, settle=self.idle_freeze.ask
            )
        self.forward = self.model

        self.kernel_plan.steps_meanwhile = self.kernel_plan.compiles_kernels

        def compile_first() -> None:
            self._compile_on(StepInputs(self.limits, self.device), compiled)
            with self.manager.stepping():
                self.forward = compiled
            if prologue is not None:
                prologue()

        settle = self.idle_freeze.ask
        return self.manager.capture_in_background(compile_first, epilogue, after, settle)

    def layer_timer_on(self, inputs: StepInputs, turn: Held) -> StepTimer | None:
        """The layer plan's timer on padding rows of ``inputs``, each timing inside
        ``turn()`` (``DeferredPlans``); None where the layers are not timed."""
        plan = self.kernel_plan
        if plan.layer_timer is None:
            return None
        return _layer_timer(self, plan.layer_rows, inputs, turn)

    def start_upgrade(
        self, config: GraphConfig, compiler: str, memory_budget: int | None = None
    ) -> StagedRuntime:
        """After ``capture`` (the first stage): starts upgrading the graphs to
        ``config``'s mode, its pieces compiled by ``compiler``, on a thread; each bucket
        moves to the upgrade where it measures faster (``ostinato.staged``), within
        ``memory_budget`` bytes of graphs; last, it asks for the heap frozen
        (``idle_freeze``), as a background capture does. Steps hold ``stepping()`` meanwhile."""
        if self.model.tp.group is not None or self.ubatch.candidates:
            raise ValueError(
                "capture='staged': not with tensor parallelism or micro-batching, whose "
                "graphs every rank captures in the same order; use capture='blocking'"
            )
        self.upgrade = GraphUpgrade(self, config, compiler)
        self.staged = StagedRuntime(
            self.graphs,
            self.upgrade.build,
            prepare=self.dummy_metadata,
            memory_budget=memory_budget,
            settle=self.idle_freeze.ask,  # (what the upgrade made lives as long as its graphs)
        )
        return self.staged

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        """A step's turn, held from writing its inputs until its outputs are read: the
        staged upgrade's or the background capture's (a no-op with neither)."""
        return self.staged.stepping() if self.staged is not None else self.manager.stepping()

    def _decode_logits(self, hidden: torch.Tensor, decode: bool, padded: int) -> StepOutput:
        """The logits of ``hidden``'s rows; for a uniform ``decode`` step in FULL mode,
        padded to ``padded`` rows (the mixed graph's size, which is the size of the
        sampling graph that reads them: both follow the capture sizes), in
        ``sample_logits``."""
        buffer = self.sample_logits
        if buffer is None or not decode or padded > buffer.shape[0]:
            return StepOutput(self.model.compute_logits(hidden))
        static = buffer[: hidden.shape[0]]
        logits = self.model.compute_logits(hidden, static)
        if logits.data_ptr() != static.data_ptr():  # (a planned LM head, or TP's gather)
            static.copy_(logits)
        return StepOutput(static, None, padded)

    def release(self) -> None:
        """Destroys every graph this runner captured (FULL and piecewise) and ends its
        micro-batch threads; it must not run a graph mode afterwards. Safe to call more
        than once. Deferred kernel plans still to be measured are measured first (a
        Ctrl-C skips that): a process that ends seconds after its start (a one-shot
        ``generate``) would otherwise leave every later start on the rules' plans too."""
        try:
            self.deferred_plans.finish()
        finally:
            self._release()

    def _release(self) -> None:
        self.ubatch.close()
        if self.staged is not None:
            self.staged.release()  # stops the thread first, then both stages' graphs
        if self.upgrade is not None:
            self.upgrade.release()
        self.manager.release()
        self.sample_logits = None
        if self.piecewise is not None:
            self.piecewise.release()
        if isinstance(self.forward, CompiledModel):
            self.forward.release()

    @torch.inference_mode()
    def execute(
        self,
        step: ScheduledBatch,
        agreement: StepAgreement | None = None,
        previous: PreviousSample | None = None,
    ) -> StepOutput:
        """Runs ``step``; returns its ``StepOutput``: logits, one row per scheduled
        request (or, for a request verifying a draft, ``1 + len(draft)`` rows: its last
        token's and each draft token's), and the argmax where the step computed it.
        ``previous``: the last launched step's samples, for decodes whose input token is
        still on the device.

        With a data-parallel ``agreement`` the step runs at the agreed padded size and
        uniformity, which every replica's identical dispatcher maps to the same mode; an
        empty ``step`` then runs as a dummy step of padding rows.
        """
        n = step.num_tokens
        lora = self.model.lora
        for load in step.lora_loads:  # (between steps: the slots' graphs need no recapture)
            assert lora is not None
            lora.load(load.slot, load.adapter.packed)
        if agreement is None:  # (the staged upgrade's routes, where it has moved any)
            has_lora = lora is not None and step.has_lora  # (no per-request scan without)
            dispatch = (self.staged or self.graphs).dispatch(n, step.uniform_decode, has_lora)
        else:
            dispatch = self.graphs.dispatch(agreement.num_tokens, agreement.uniform_decode)
            if dispatch.mode is not agreement.mode or dispatch.padded_tokens < n:
                raise RuntimeError(
                    f"data-parallel step: the agreed {agreement} dispatches to {dispatch} "
                    f"here, for {n} local tokens; the replicas' graph configs differ"
                )
        padded = dispatch.padded_tokens
        if padded > self.limits.max_num_batched_tokens:
            raise ValueError(
                f"step of {n} tokens exceeds max_num_batched_tokens="
                f"{self.limits.max_num_batched_tokens}"
            )
        if not step.scheduled:
            self.inputs.write_padding(padded)
            self.manager.run(dispatch, 0, attn_metadata=self.metadata(padded, [], []))
            return StepOutput(torch.empty((0, self.model.config.vocab_size), device=self.device))
        layout = self.inputs.write(step, padded, previous)
        ubatch = (
            self.ubatch.applies(dispatch.mode, padded, step)
            if agreement is None
            else agreement.micro_batch
        )
        if ubatch and dispatch.mode is GraphMode.NONE:  # (a FULL graph holds its split)
            hidden = self.ubatch.run_eager(padded, layout.query_lens, layout.seq_lens)
            return StepOutput(self.model.compute_logits(hidden[layout.logit_index]))
        meta = self.metadata(padded, layout.query_lens, layout.seq_lens)
        return self.run_logits(dispatch, n, meta, layout.logit_index, step.uniform_decode)


def _layer_timer(
    runner: ModelRunner,
    sizes: tuple[int, ...],
    inputs: StepInputs | None = None,
    turn: Held | None = None,
) -> StepTimer:
    """Times decode steps as ``runner``'s FULL decode graphs run them (``layer_tuning``)
    on padding rows of ``inputs`` (default: the steps' own), the kernels of every size
    compiled ahead first where ``compile_ahead`` asks. With ``turn`` (beside running
    steps) each timed replay holds it and replays one step, not four: a step waits
    for one step's replay (``held_replay_us``), not eight."""
    inputs = inputs or runner.inputs

    def context(n: int) -> contextlib.AbstractContextManager:
        d = BatchDescriptor(n, n, uniform_decode=True)
        return forward_context(GraphMode.FULL, d, runner.dummy_metadata(d, inputs))

    ahead = sizes if runner.kernels.compile_ahead else ()
    model, ids, positions = runner.model, inputs.input_ids, inputs.positions
    if turn is None:
        return graph_timer(model, ids, positions, context, ahead)
    return graph_timer(model, ids, positions, context, ahead, steps=1, replays=9, turn=turn)


def _eager_pass(
    runner: ModelRunner, dispatch: Dispatch, meta: StepAttention, rows: torch.Tensor | slice
) -> None:
    """``KernelPlan.compile_first``'s pass of a step: its work as the manager runs it
    eagerly, then the logits of ``rows`` (a uniform decode's are its own); the capture
    thread goes on beside it (``want``: its graphs come sooner)."""
    d, background = dispatch.descriptor, runner.manager.background
    if background is not None and not background.done:
        background.want(d)
    with forward_context(GraphMode.NONE, d, meta):
        out = runner._step(d)
    if not d.uniform_decode:
        runner.model.compute_logits(out[rows])


def _static_rows() -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Inside a FULL capture of a uniform decode step, the static buffers' rows for its
    logits and greedy tokens (``ForwardContext.outputs``): written there, no replay
    copies them. (None, None) elsewhere."""
    context = current_forward_context()
    into = context.outputs if context is not None else None
    if into is None or len(into) != 2:
        return None, None
    return into[0], into[1]


def runner_kernels(built: KernelOptions, device: torch.device) -> KernelOptions:
    """The options a runner on ``device`` follows for a model built with ``built``: what
    the device has of them (``KernelOptions.available_on``). On CUDA a model built with an
    option the device cannot run is refused (its kernels would launch with it);
    elsewhere no launch option reaches a kernel, so it runs with them off."""
    kernels = built.available_on(device)
    if device.type == "cuda" and kernels != built:
        raise ValueError(
            f"kernels: the model was built with {built}, which {device} cannot run; "
            "build it with KernelOptions.resolved(device)"
        )
    return kernels
