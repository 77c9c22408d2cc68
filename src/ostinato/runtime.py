"""The one entry point that wires graphs for a model runner: ``build_graph_runtime``.

It turns a ``GraphConfig`` and what the caller knows (how much of a step its attention
can capture, whether its model is compiled with the piecewise backend, which platform its
tensors live on) into the resolved mode with the reasons for any downgrade, the dispatch
table and the ``GraphManager``, reading warm-ups and checks from the config. The "auto"
choices (of the mode, and of the piecewise compiler) live here too. Runners, the demo and
the README use it; nothing else calls ``resolve_mode`` or overrides a dispatcher's mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ostinato.config import GraphConfig
from ostinato.dispatcher import Dispatch, Dispatcher
from ostinato.graph_outputs import PoolOutputs, StaticOutputs
from ostinato.manager import GraphManager, PerturbFn, PrepareFn, StepFn
from ostinato.modes import GraphMode
from ostinato.platform import Platform, current_platform
from ostinato.resolution import AttentionGraphSupport, ModeResolution, resolve_mode

COMPILERS = ("inductor", "eager")


@dataclass(frozen=True)
class GraphRuntime:
    """Graphs for one model runner: ``resolution`` (the mode in use and why it differs
    from the one asked for), ``dispatcher`` (O(1) mode and padded size per step) and
    ``manager`` (capture at start-up, run per step)."""

    resolution: ModeResolution
    manager: GraphManager

    @property
    def dispatcher(self) -> Dispatcher:
        """The manager's dispatcher (a new one after ``GraphManager.resize``)."""
        return self.manager.dispatcher

    @property
    def mode(self) -> GraphMode:
        """The resolved mode."""
        return self.resolution.mode

    def dispatch(
        self, num_tokens: int, uniform_decode: bool = False, has_lora: bool = False
    ) -> Dispatch:
        """The step's runtime mode and padded descriptor: write inputs up to
        ``padded_tokens`` rows, then ``manager.run(dispatch, num_tokens, ...)``."""
        return self.dispatcher.dispatch(num_tokens, uniform_decode, has_lora)


def auto_mode(platform_has_graphs: bool, piecewise_available: bool) -> GraphMode:
    """What ``mode="auto"`` means: FULL_AND_PIECEWISE where pieces can be compiled, FULL
    where only whole steps can be captured, NONE on a platform without graphs."""
    if not platform_has_graphs:
        return GraphMode.NONE
    return GraphMode.FULL_AND_PIECEWISE if piecewise_available else GraphMode.FULL


def choose_compiler(
    choice: str | None, mode: GraphMode | None, platform: Platform | None = None
) -> str | None:
    """The piecewise compiler: ``choice`` itself, or for ``"auto"`` Inductor when the
    platform has graphs and the mode (None: auto) wants piecewise graphs, else None."""
    if choice != "auto":
        if choice is not None and choice not in COMPILERS:
            raise ValueError(f"compiler: 'auto', 'inductor', 'eager' or None, got {choice!r}")
        return choice
    platform = platform or current_platform()
    wants_pieces = mode is None or mode.has_piecewise_graphs()
    return "inductor" if platform.supports_graphs and wants_pieces else None


def build_graph_runtime(
    step: StepFn,
    config: GraphConfig,
    *,
    attention: AttentionGraphSupport = AttentionGraphSupport.ALWAYS,
    piecewise_available: bool = False,
    prepare: PrepareFn | None = None,
    perturb_padding: PerturbFn | None = None,
    uniform_decode_query_len: int = 1,
    max_num_reqs: int | None = None,
    lora_enabled: bool = False,
    platform: Platform | None = None,
    pool: Any = None,
    progress: bool = True,
    outputs: StaticOutputs | PoolOutputs | None = None,
    warm_step: StepFn | None = None,
) -> GraphRuntime:
    """Resolves ``config.mode`` (``"auto"`` included) against ``attention``, piecewise
    availability and ``platform`` (default: the current one; pass ``CpuPlatform()`` for a
    runner whose tensors are on the CPU), logs every downgrade with its reason, and builds
    the dispatcher and the manager. ``step``, ``prepare``, ``perturb_padding``,
    ``warm_step`` and ``outputs`` (another manager's static outputs, shared: the two
    steps must return the same shapes and never replay at once; or ``PoolOutputs``) are
    ``GraphManager``'s."""
    platform = platform or current_platform()
    requested = config.mode or auto_mode(platform.supports_graphs, piecewise_available)
    resolution = resolve_mode(
        requested,
        attention,
        piecewise_available=piecewise_available,
        platform_has_graphs=platform.supports_graphs,
        uniform_decode_query_len=uniform_decode_query_len,
    )
    dispatcher = Dispatcher(
        config,
        resolution.mode,
        uniform_decode_query_len=uniform_decode_query_len,
        max_num_reqs=max_num_reqs,
        lora_enabled=lora_enabled,
    )
    manager = GraphManager(
        step,
        dispatcher,
        prepare=prepare,
        num_warmups=config.num_warmups,
        check=config.replay_check,
        perturb_padding=perturb_padding,
        progress=progress,
        platform=platform,
        pool=pool,
        outputs=outputs,
        warm_step=warm_step,
    )
    return GraphRuntime(resolution, manager)
