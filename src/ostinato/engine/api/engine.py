"""``Engine``: one model's scheduler, runner and sampler, and the one path requests take
through them. A step reads: schedule, execute, sample, resolve (``Engine.step``).

Requests enter and leave through a ``Session`` (``LLM.generate`` and the serve loop both
use it): ``checked`` turns prompts and parameters into what the scheduler takes (or
names what is wrong), ``admit`` queues one under its public id, ``Tracked.take`` hands
out its new tokens, ``end`` forgets its id. Nothing outside this module touches the
scheduler or the request book.
"""

from __future__ import annotations

import gc
import itertools
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ostinato.adaptive_ladder import AdaptiveLadder, AdaptivePolicy, LadderChange
from ostinato.background import BackgroundCapture
from ostinato.capture_report import CaptureReport
from ostinato.distributed.failure import RankFailure
from ostinato.distributed.groups import ParallelGroups
from ostinato.distributed.symm_all_reduce import SymmetricAllReduce
from ostinato.engine.api.engine_args import EngineArgs
from ostinato.engine.api.lora_registry import (
    LoraNames,
    LoraNotEnabled,
    LoraRegistry,
    resolve_without_lora,
)
from ostinato.engine.api.prompts import Prompt, check_params, check_prompts
from ostinato.engine.api.step_loop import StepLoop
from ostinato.engine.core.kv_cache import KVCache
from ostinato.engine.core.lora_slots import LoraAdapter
from ostinato.engine.core.params import SamplingParams
from ostinato.engine.core.request_book import RequestBook
from ostinato.engine.core.scheduler import FinishReason, Request, Scheduler
from ostinato.engine.kernels.options import KernelOptions
from ostinato.engine.model.all_reduce_norm_op import FusedReduceNorm
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.parallel.step_mirror import SchedulerChange, StepMirror
from ostinato.engine.sample.step_sampler import StepSampler
from ostinato.engine.spec.self_draft import SelfDraftProposer
from ostinato.engine.spec.speculative import SpeculativeConfig, SpeculativeStats
from ostinato.engine.worker.compile_cache import CompileCache
from ostinato.engine.worker.memory import GraphMemoryCheck, MemoryPlan
from ostinato.engine.worker.runner import ModelRunner
from ostinato.modes import GraphMode
from ostinato.platform import exclusive_device
from ostinato.replay_stats import StatsSnapshot
from ostinato.resolution import ModeResolution
from ostinato.staged import StagedRuntime


@dataclass
class StartupTimes:
    """Where the construction's seconds went: opening the model (config, tokenizer, and
    on a model-cache miss the conversion, whose tokenizer and cache entry are made beside
    the later phases and waited for at the end, in the total), making or loading the
    weights on the device,
    compiling the model's pieces (Inductor), capturing the graphs, and the total (the
    rest: process groups, the KV cache, the memory plan). Of the capture: the kernels'
    plans and their compile or load ahead (``kernels_s``), the step graphs' recording
    alone (``recording_s``, the capture report's seconds) and the sampling graphs
    (``sampling_s``); the rest of it warms up and times the layer plan where measured."""

    open_s: float
    weights_s: float
    compile_s: float
    capture_s: float
    total_s: float = 0.0
    background: bool = False
    recording_s: float = 0.0
    sampling_s: float = 0.0
    kernels_s: float = 0.0
    gemm_plan_s: float = 0.0  # of ``kernels_s``: the GEMM plan
    layer_plan_s: float = 0.0  # and the layer plan
    plans_deferred: bool = False  # the rules' plans first, measured after the graphs

    def summary(self) -> str:
        """One line: ``start-up 12.3 s (open 0.4, weights 1.0, compile 8.0, capture 2.0;
        kernels 0.3, recording 0.7, sampling 0.9)``; with background capture, ``start-up
        2.1 s (open 0.4, weights 1.0; compile and capture in the background)``, naming
        the kernels' plans too where they took a tenth of a second or more, and then the
        GEMM and the layer plans apart (``gemm plan 12.1, layer plan 6.9``), or that
        they are the rules' until measured after the graphs (a first start's)."""
        head = (
            f"start-up {self.total_s:.1f} s (open {self.open_s:.1f}, weights {self.weights_s:.1f}"
        )
        if self.background:
            plans = ""
            if self.kernels_s >= 0.1:
                plans = f", kernel plans {self.kernels_s:.1f}{self._plans()}"
            later = ", then the kernel plans measured" if self.plans_deferred else ""
            return head + plans + f"; compile and capture in the background{later})"
        return (
            head + f", compile {self.compile_s:.1f}, capture {self.capture_s:.1f}; "
            f"kernels {self.kernels_s:.1f}{self._plans()}, recording {self.recording_s:.1f}, "
            f"sampling {self.sampling_s:.1f})"
        )

    def _plans(self) -> str:
        if max(self.gemm_plan_s, self.layer_plan_s) < 0.1:
            return ""
        return f", gemm plan {self.gemm_plan_s:.1f}, layer plan {self.layer_plan_s:.1f}"


@dataclass
class EngineParts:
    """An engine's parts as ``startup.build`` makes them, in order; ``release`` drops
    every device tensor they hold (a failed start-up leaves the device as it found it)."""

    args: EngineArgs
    device: torch.device
    dtype: torch.dtype
    config: ModelConfig
    tokenizer: Any
    source_name: str
    eos_token_ids: tuple[int, ...]
    kernels: KernelOptions  # resolved for ``device`` (every option True or False)
    speculative: SpeculativeConfig | None
    compile_cache: CompileCache | None
    tokenizer_pending: bool = False  # a converted model's, until the end of ``build``
    parallel: ParallelGroups = None  # type: ignore[assignment]  (set by init_parallel)
    all_reduce: SymmetricAllReduce | None = None
    all_reduce_norm: FusedReduceNorm | None = None  # the all-reduce fused with the norm
    memory: MemoryPlan | None = None
    model: DecoderModel | None = None
    cache: KVCache | None = None
    runner: ModelRunner = None  # type: ignore[assignment]
    scheduler: Scheduler = None  # type: ignore[assignment]
    sampler: StepSampler = None  # type: ignore[assignment]
    drafter: SelfDraftProposer | None = None
    background: BackgroundCapture | StagedRuntime | None = None  # captures or upgrades
    adapters: LoraRegistry | None = None  # with enable_lora
    capture_report: CaptureReport = None  # type: ignore[assignment]
    draft_report: CaptureReport | None = None
    graph_memory: GraphMemoryCheck | None = None
    startup: StartupTimes = None  # type: ignore[assignment]
    spec_stats: SpeculativeStats = field(default_factory=SpeculativeStats)

    def release(self) -> None:
        """Destroys the graphs and drops the device tensors; safe to call again."""
        if self.runner is not None:
            self.runner.release()
        if self.drafter is not None:
            self.drafter.release()
        if self.all_reduce is not None:
            self.all_reduce.release()
        if self.all_reduce_norm is not None:
            self.all_reduce_norm.release()
        self.runner = self.drafter = self.all_reduce = self.all_reduce_norm = None  # type: ignore[assignment]
        self.model = self.cache = self.scheduler = self.sampler = None  # type: ignore[assignment]
        # What the start froze (``freeze_heap``) can be collected again: cycles among the
        # engine's own objects would otherwise outlive it, its device memory with them.
        gc.unfreeze()
        gc.collect()
        if self.device.type == "cuda":
            with exclusive_device():  # not during another engine's capture
                torch.cuda.empty_cache()


@dataclass
class Tracked:
    """A request as its caller follows it: the public id, the scheduler's request, and
    how many of its tokens were handed out (``take``)."""

    request_id: str
    request: Request
    emitted: int = 0

    def take(self) -> list[int]:
        """The tokens produced since the last ``take``."""
        new = self.request.output[self.emitted :]
        self.emitted += len(new)
        return new

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.request.finish_reason


def _part(name: str) -> property:
    return property(lambda self: getattr(self.parts, name))


class Engine:
    """One model's scheduler, runner and sampler (built by ``startup.build``).

    Guarantees: one thread steps it at a time (``LLM`` owns that); the host waits on the
    device once per step, to read the sampled tokens; requests enter and leave only
    through a ``Session``, under public ids that name at most one live request."""

    # Read from the parts, so a released engine holds nothing of its own.
    args = _part("args")
    device, dtype, config = _part("device"), _part("dtype"), _part("config")
    tokenizer, source_name = _part("tokenizer"), _part("source_name")
    parallel, runner, scheduler = _part("parallel"), _part("runner"), _part("scheduler")
    model, cache, sampler, drafter = (
        _part("model"),
        _part("cache"),
        _part("sampler"),
        _part("drafter"),
    )
    speculative, spec_stats = _part("speculative"), _part("spec_stats")

    def __init__(self, parts: EngineParts, peer_failure: Callable[[], RankFailure | None]) -> None:
        self.parts = parts
        self.requests = RequestBook()  # live requests by public id; aborts from any thread
        self._ids = itertools.count()  # ids of requests their caller did not name
        self.loop = StepLoop(
            parts.runner,
            parts.scheduler,
            parts.sampler,
            parts.parallel,
            parts.speculative is not None,
            parts.spec_stats,
            peer_failure,
        )
        # Data-parallel replicas agree on each step before it runs, and a verify step's
        # outcome decides the next draft: both step in turn.
        alone = parts.args.parallel.data_parallel_size == 1
        self.async_scheduling = parts.args.async_scheduling and alone and parts.speculative is None
        self._steps = self.loop.async_steps if self.async_scheduling else self.loop.sync_steps
        self._needs_reset = False  # a failed call's reset was itself interrupted
        self._call_owner: object | None = None  # the request ids of the call running last

    def step(self) -> list[Request] | None:
        """One step: schedule, execute, sample, resolve (``StepLoop.step``); the requests
        that finished. None when, under data parallelism, no replica had work left."""
        return self.loop.step()

    def steps(self) -> Iterator[None]:
        """Steps as configured (asynchronously where it applies) until no request is
        left; yields after each step's tokens are recorded. A heap freeze asked for
        (``ModelRunner.idle_freeze``) runs before the first step and after the last, when
        no request is running, or between two steps once overdue."""
        freeze, steps = self.runner.idle_freeze, self._steps()
        try:
            freeze.at_idle()
            for _ in steps:
                freeze.between_steps()
                yield
            freeze.at_idle()
        finally:
            # An interrupt in these lines does not pass through the inner steps: left
            # suspended, they kept what they held and another call waited for it
            # (tests/engine/test_interrupts.py). Closing them lets it go.
            steps.close()

    def checked(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        lora: LoraNames = None,
    ) -> list[tuple[list[int], SamplingParams, LoraAdapter | None]]:
        """Every prompt as token ids with its parameters and LoRA adapter (``lora``: a
        name for all, or one per prompt; ``adapters_for``), all checked before anything
        is queued (``ValueError`` / ``TypeError`` naming the prompt and the problem)."""
        fits = self.scheduler.check
        tokens = check_prompts(prompts, self.tokenizer, self.config.vocab_size, fits)
        checked = check_params(params, len(tokens))
        if self.tokenizer is None and any(p.stop for p in checked):
            raise ValueError("stop: stop strings need the model's tokenizer; this model has none")
        if self.speculative is not None and any(p.seed is not None for p in checked):
            raise ValueError(
                "seed: not with speculative decoding, whose verify steps draw from the "
                "engine's generator; leave seed out, or serve without speculation"
            )
        if self.speculative is not None and any(p.logprobs is not None for p in checked):
            raise ValueError("logprobs: not with speculative decoding (its verify steps)")
        adjusts = next((p for p in checked if p.adjusts_logits), None)
        if self.speculative is not None and adjusts is not None:
            name = "logit_bias" if adjusts.logit_bias else "presence_penalty / frequency_penalty"
            raise ValueError(f"{name}: not with speculative decoding (its verify steps)")
        vocab = self.config.vocab_size
        for p in checked:
            for name, ids in (
                ("logit_bias", [t for t, _ in p.logit_bias]),
                ("stop_token_ids", p.stop_token_ids),
            ):
                bad = next((t for t in ids if t >= vocab), None)
                if bad is not None:
                    raise ValueError(f"{name}: token id {bad} outside the vocabulary [0, {vocab})")
        adapters = self.adapters_for(lora, len(tokens))
        return list(zip(tokens, checked, adapters, strict=True))

    def lora(self, what: str) -> LoraRegistry:
        """The LoRA adapters (``LoraRegistry``: ``load`` checks an adapter against the
        model and packs it, from any thread; it reaches a device slot when a request
        first uses it); ``what`` names the call refused without ``enable_lora``."""
        adapters = self.parts.adapters
        if adapters is None:
            raise LoraNotEnabled(
                f"{what}: this engine was built without LoRA; use enable_lora=True"
            )
        return adapters

    @property
    def lora_names(self) -> list[str]:
        """The loaded LoRA adapters' names (empty without ``enable_lora``)."""
        adapters = self.parts.adapters
        return adapters.names if adapters is not None else []

    def adapters_for(self, names: LoraNames, count: int) -> list[LoraAdapter | None]:
        """The adapter of each of ``count`` prompts (``LoraRegistry.resolve``); without
        LoRA, only None is accepted."""
        adapters = self.parts.adapters
        if adapters is None:
            return resolve_without_lora(names, count)
        return adapters.resolve(names, count)

    def request_ids(self, given: Sequence[str] | None, n: int) -> list[str]:
        """``given`` (one id per prompt of ``n``), or ``n`` new ids ``generate-K``."""
        if given is None:
            return [f"generate-{next(self._ids)}" for _ in range(n)]
        if isinstance(given, str) or len(given) != n:
            raise ValueError(f"request_ids: expected a sequence of {n} ids, one per prompt")
        return list(given)

    def reserve(self, request_ids: Sequence[str], owner: Hashable) -> None:
        """Claims ids for new requests of ``owner``, all or none (``RequestBook.reserve``);
        ``end(owner)`` afterwards, whether or not it raised."""
        self.requests.reserve(request_ids, owner)

    def new_call(self) -> object:
        """An owner for one call's request ids (``reserve``). Calls run one at a time, so
        what the call before still holds, if an interrupt kept it from ``end``, is ended
        here."""
        if self._call_owner is not None:
            self.requests.release(self._call_owner)
        self._call_owner = object()
        return self._call_owner

    def end(self, owner: Hashable) -> None:
        """Forgets the ids ``owner`` reserved (its requests ended, or never started)."""
        self.requests.release(owner)

    def abort(self, request_id: str) -> bool:
        """Asks for a live request to end at the next step boundary (any thread)."""
        return self.requests.abort(request_id)

    def reset_if_interrupted(self) -> None:
        """Resets the scheduler where an earlier call's reset was itself interrupted."""
        if self._needs_reset:
            self.scheduler.reset()
            self._needs_reset = False

    def reset(self) -> None:
        """Drops every queued and running request, freeing its blocks. An interrupt
        inside it leaves the flag up: the next call resets first."""
        self._needs_reset = True
        self.scheduler.reset()
        self._needs_reset = False

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

    @property
    def num_preemptions(self) -> int:
        """Requests preempted (their KV blocks freed, recomputed later) so far."""
        return self.scheduler.num_preemptions

    @property
    def has_work(self) -> bool:
        """Whether requests are queued or running (never after ``generate`` returns)."""
        return self.scheduler.has_work

    def graph_stats(self) -> StatsSnapshot:
        """Live statistics per bucket (replays, real and padded rows, eager steps by
        reason, capture cost); safe to call while another thread steps."""
        return self.runner.manager.stats()

    def describe(self) -> str:
        """One line: the model, device, graph mode, kernel options, start-up phases and
        graphs."""
        parts = self.parts
        background = parts.background
        capturing = isinstance(background, BackgroundCapture) and not background.done
        graphs = "graphs: background" if capturing else parts.capture_report.summary()
        if isinstance(background, StagedRuntime):
            graphs += f"; {background.summary()}"
        if self.runner.deferred_plans.recaptured:
            graphs += f"; {self.runner.deferred_plans.summary()}"
        if parts.graph_memory is not None:
            graphs += f" ({parts.graph_memory.summary()})"
        manager = self.runner.manager
        if manager.check.mode != "off":
            every = f" 1 in {manager.check.every}" if manager.check.sampling else ""
            graphs += f"; verify: {manager.check.mode}{every}, {len(manager.demoted)} demoted"
        return (
            f"model: {self.source_name}; device: {self.device}; graph mode: {self.mode.name}; "
            f"{self.runner.kernels.summary(self.device)}; {parts.startup.summary()}; {graphs}"
        )

    @property
    def plans_pending(self) -> bool:
        """Whether kernel plans deferred at start-up are still to be measured (after the
        graphs, on their thread; ``release`` measures them first)."""
        return self.runner.kernel_plan.deferred

    def wait_for_graphs(
        self, timeout: float | None = None, owner: threading.Lock | None = None
    ) -> bool:
        """Waits (at most ``timeout`` seconds) for a background capture or a staged
        upgrade to end; True when every graph is ready (at once after a blocking
        capture), False on a timeout or when the capture or upgrade failed
        (``background.error`` says why; steps run eagerly, or on the first stage).
        Then, where ``owner`` (the lock of whoever steps this engine) is free, the heap
        freeze the end asked for runs under it (``ModelRunner.idle_freeze``)."""
        background = self.parts.background
        ready = background is None or (background.wait(timeout) and background.error is None)
        if owner is not None and owner.acquire(blocking=False):
            try:
                self.runner.idle_freeze.at_idle()
            finally:
                owner.release()
        return ready

    def replan_graphs(self, budget_bytes: int, granule: int = 1 << 20) -> LadderChange | None:
        """Between steps (none in flight): moves the FULL ladder to the sizes that pad least
        for the steps run so far, charged the pool bytes each size took at capture, within
        ``budget_bytes`` (``ostinato.adaptive_ladder``). Returns the change, or None when
        the ladder held already pads least within the budget. Only in FULL mode, its
        graphs captured (blocking, or a background capture that finished; not staged)
        and without small-GEMM plans (planned per captured size); ``ValueError`` names
        what stands in the way."""
        background = self.parts.background
        settled = isinstance(background, BackgroundCapture) and background.finished
        if self.mode is not GraphMode.FULL or (background is not None and not settled):
            how = ", capturing in the background" if background else ""
            raise ValueError(
                "replan_graphs: needs graph mode FULL with its graphs captured: blocking, "
                f"or wait_for_graphs() after a background capture (this engine runs "
                f"{self.mode.name}{how})"
            )
        if self.runner.kernel_plan.small_gemm_rows:
            raise ValueError(
                "replan_graphs: the small-GEMM plans were measured for the captured sizes "
                "(KernelOptions(small_gemm=True), the default on CUDA), so sizes moved to "
                "would run unplanned; build the engine with "
                "kernels=KernelOptions(small_gemm=False) to move its ladder"
            )
        policy = AdaptivePolicy(budget_bytes, every=1, max_resizes=1, min_gain=0.0, granule=granule)
        return AdaptiveLadder(self.runner.manager, policy).between_steps()

    @property
    def waiting(self) -> int:
        """Requests queued for a seat."""
        return len(self.scheduler.waiting)

    def release(self) -> None:
        """Destroys every graph and device tensor; the engine cannot step afterwards."""
        self.parts.release()
        self.loop = None  # type: ignore[assignment]

    @property
    def closed(self) -> bool:
        """Whether ``release`` ran."""
        return self.parts.scheduler is None


Send = Callable[[str, list[SchedulerChange]], None]


class Session:
    """The engine as a caller drives it between steps: admit requests, apply aborts,
    run steps. With ``send`` (rank 0 of an engine with worker processes) every change
    reaches the workers before the step after it (``parallel.step_mirror``)."""

    def __init__(
        self, engine: Engine, steps: Callable[[], Iterator[None]], send: Send | None = None
    ) -> None:
        self.engine = engine
        self.mirror = StepMirror(engine.scheduler, steps, send)

    def admit(
        self,
        request_id: str,
        tokens: list[int],
        params: SamplingParams,
        lora: LoraAdapter | None = None,
    ) -> Tracked:
        """Queues a checked request under its reserved id (with ``lora``'s adapter)."""
        request = self.mirror.add(tokens, params, lora)
        self.engine.requests.bind(request_id, request)
        return Tracked(request_id, request)

    def aborted_early(self, request_id: str) -> bool:
        """Whether an abort was asked for ``request_id`` before it was admitted."""
        return self.engine.requests.aborted(request_id)

    def apply_aborts(self) -> None:
        """Ends the requests whose abort was asked (finish reason ABORT)."""
        self.mirror.abort(self.engine.requests.take_aborts())

    def abort(self, tracked: Sequence[Tracked]) -> None:
        """Ends these requests now (finish reason ABORT)."""
        self.mirror.abort([t.request for t in tracked])

    @property
    def has_work(self) -> bool:
        return self.engine.scheduler.has_work

    def steps(self) -> Iterator[None]:
        return self.mirror.steps()

    def reset(self) -> None:
        self.mirror.reset()

    def end(self) -> None:
        """Sends the workers what they have not seen yet (the session ends)."""
        self.mirror.end()
