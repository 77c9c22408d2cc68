"""The engine's staged start: the upgrade stage of a runner's graphs.

A staged runner captures FULL graphs of its own (eager, fused) model at start-up, which
takes seconds and compiles nothing, and serves with them. ``GraphUpgrade.build`` then
runs on the staged thread (``ostinato.staged``): it compiles the model with the
piecewise backend, in a graph pool of its own, on scratch inputs (the steps' buffers are
never touched), and returns the graph runtime of the mode asked for (FULL_AND_PIECEWISE
by default), whose buckets ``StagedRuntime`` captures, times against the first stage's
and moves where faster.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ostinato.batch import BatchDescriptor
from ostinato.config import GraphConfig
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.model.attention import AttentionBackend
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.worker.inputs import StepInputs
from ostinato.engine.worker.kernel_plan import KernelPlan
from ostinato.manager import GraphManager
from ostinato.modes import GraphMode
from ostinato.piecewise import CompiledModel, PiecewiseBackend
from ostinato.runtime import GraphRuntime, build_graph_runtime


class Upgradable(Protocol):
    """What the upgrade reads of its runner (``ModelRunner``; named here, not imported,
    since the runner imports this module)."""

    model: DecoderModel
    limits: EngineLimits
    device: torch.device
    backend: AttentionBackend
    kernel_plan: KernelPlan
    graphs: GraphRuntime

    @property
    def manager(self) -> GraphManager: ...

    def dummy_metadata(self, d: BatchDescriptor) -> Any: ...

    def step_as(
        self, d: BatchDescriptor, ubatched: bool, mode: GraphMode | None, forward: Any
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


class GraphUpgrade:
    """The upgrade of ``runner``'s graphs to ``config``'s mode, its pieces compiled by
    ``compiler``. ``build`` runs once, on the staged thread; ``release`` gives back what
    it made (safe before ``build`` and more than once)."""

    def __init__(self, runner: Upgradable, config: GraphConfig, compiler: str) -> None:
        self.runner, self.config, self.compiler = runner, config, compiler
        self.piecewise: PiecewiseBackend | None = None
        self.forward: CompiledModel | None = None
        self.runtime: GraphRuntime | None = None

    def build(self) -> GraphRuntime:
        """Compiles the model's pieces and returns the upgrade's graph runtime (nothing
        captured yet)."""
        runner = self.runner
        platform = runner.manager.platform
        pool = platform.graph_pool_handle()  # its own: released without the first stage's
        self.piecewise = PiecewiseBackend(
            compiler=self.compiler,
            check_addresses=self.config.check_addresses,
            platform=platform,
            pool=pool,
            inductor_patches=None,  # (as the runner's own: plain launches in Inductor's kernels)
        )
        self.forward = CompiledModel(runner.model, self.piecewise)
        scratch = StepInputs(runner.limits, runner.device)
        sync = platform.synchronize_outside_capture
        runner.kernel_plan.compile_on(scratch, self.forward, self.piecewise, sync)
        self.runtime = build_graph_runtime(
            self._step,
            self.config,
            attention=runner.backend.graph_support,
            piecewise_available=True,
            prepare=runner.dummy_metadata,
            max_num_reqs=runner.limits.max_num_seqs,
            uniform_decode_query_len=runner.graphs.dispatcher.uniform_decode_query_len,
            platform=platform,
            progress=False,
            pool=pool,
        )
        return self.runtime

    def _step(self, d: BatchDescriptor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        assert self.runtime is not None and self.forward is not None  # set by build
        return self.runner.step_as(d, False, self.runtime.mode, self.forward)

    def release(self) -> None:
        """Releases the compiled pieces' graphs (the staged runtime releases the
        upgrade's FULL graphs)."""
        if self.piecewise is not None:
            self.piecewise.release()
        if self.forward is not None:
            self.forward.release()
        self.piecewise = self.forward = None
