"""ostinato: capture PyTorch models as CUDA graphs and replay them for any batch size.

The public API, by layer (see docs/design.md): modes and configuration (``GraphMode``,
``GraphConfig``, ``BatchDescriptor``, ``Dispatcher``, ``forward_context``), graphs
(``GraphWrapper``, ``capture_phase``, ``shared_pool``), and runner pieces
(``GraphManager``, and ``build_graph_runtime``, the one entry point that wires them),
``graphed`` (any callable as graphs in one call),
and what they did (``CaptureReport``; ``StatsSnapshot``, live per bucket).

The names are loaded on first use: ``import ostinato`` imports neither torch nor any of
its modules, so a command line that only parses its arguments starts at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_HOMES = {
    "AdaptiveLadder": "ostinato.adaptive_ladder",
    "AdaptivePolicy": "ostinato.adaptive_ladder",
    "GraphDemotedWarning": "ostinato.replay_check",
    "ReplayCheck": "ostinato.replay_check",
    "UpdateOrder": "ostinato.param_updates",
    "AttentionGraphSupport": "ostinato.resolution",
    "BackgroundCapture": "ostinato.background",
    "BatchDescriptor": "ostinato.batch",
    "BucketStats": "ostinato.replay_stats",
    "CaptureItem": "ostinato.batch",
    "CapturePlan": "ostinato.capture_planner",
    "CaptureNotAllowedError": "ostinato.errors",
    "CaptureReport": "ostinato.capture_report",
    "Dispatch": "ostinato.dispatcher",
    "Dispatcher": "ostinato.dispatcher",
    "EagerReason": "ostinato.replay_stats",
    "ForwardContext": "ostinato.context",
    "GraphCaptureError": "ostinato.errors",
    "GraphConfig": "ostinato.config",
    "GraphEntry": "ostinato.graph",
    "GraphManager": "ostinato.manager",
    "GraphMode": "ostinato.modes",
    "GraphOptions": "ostinato.graph",
    "GraphRecord": "ostinato.capture_report",
    "GraphRuntime": "ostinato.runtime",
    "GraphWrapper": "ostinato.graph",
    "Graphed": "ostinato.callable_graphs",
    "GraphedStats": "ostinato.callable_graphs",
    "InputAddressChangedError": "ostinato.errors",
    "ModeResolution": "ostinato.resolution",
    "OstinatoError": "ostinato.errors",
    "PaddingChangesRealRowsError": "ostinato.callable_graphs",
    "PlatformError": "ostinato.errors",
    "StagedRuntime": "ostinato.staged",
    "compiled_graphs": "ostinato.backend",
    "StatsSnapshot": "ostinato.replay_stats",
    "auto_mode": "ostinato.runtime",
    "build_graph_runtime": "ostinato.runtime",
    "capture_phase": "ostinato.guard",
    "choose_compiler": "ostinato.runtime",
    "current_forward_context": "ostinato.context",
    "current_platform": "ostinato.platform",
    "default_capture_sizes": "ostinato.config",
    "forward_context": "ostinato.context",
    "get_forward_context": "ostinato.context",
    "graphed": "ostinato.callable_graphs",
    "in_capture_phase": "ostinato.guard",
    "plan_capture_sizes": "ostinato.capture_planner",
    "resolve_mode": "ostinato.resolution",
    "shared_pool": "ostinato.pool",
    "use_platform": "ostinato.platform",
}


__all__ = [
    "AdaptiveLadder",
    "AdaptivePolicy",
    "GraphDemotedWarning",
    "ReplayCheck",
    "UpdateOrder",
    "AttentionGraphSupport",
    "BackgroundCapture",
    "BatchDescriptor",
    "BucketStats",
    "CaptureItem",
    "CapturePlan",
    "CaptureNotAllowedError",
    "CaptureReport",
    "Dispatch",
    "Dispatcher",
    "EagerReason",
    "ForwardContext",
    "GraphCaptureError",
    "GraphConfig",
    "GraphEntry",
    "GraphManager",
    "GraphMode",
    "GraphOptions",
    "GraphRecord",
    "GraphRuntime",
    "GraphWrapper",
    "Graphed",
    "GraphedStats",
    "InputAddressChangedError",
    "ModeResolution",
    "OstinatoError",
    "PaddingChangesRealRowsError",
    "PlatformError",
    "StagedRuntime",
    "StatsSnapshot",
    "auto_mode",
    "build_graph_runtime",
    "capture_phase",
    "compiled_graphs",
    "choose_compiler",
    "current_forward_context",
    "current_platform",
    "default_capture_sizes",
    "forward_context",
    "get_forward_context",
    "graphed",
    "in_capture_phase",
    "plan_capture_sizes",
    "resolve_mode",
    "shared_pool",
    "use_platform",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ loads them
    from ostinato.adaptive_ladder import AdaptiveLadder, AdaptivePolicy
    from ostinato.backend import compiled_graphs
    from ostinato.background import BackgroundCapture
    from ostinato.batch import BatchDescriptor, CaptureItem
    from ostinato.callable_graphs import Graphed, GraphedStats, PaddingChangesRealRowsError, graphed
    from ostinato.capture_planner import CapturePlan, plan_capture_sizes
    from ostinato.capture_report import CaptureReport, GraphRecord
    from ostinato.config import GraphConfig, default_capture_sizes
    from ostinato.context import (
        ForwardContext,
        current_forward_context,
        forward_context,
        get_forward_context,
    )
    from ostinato.dispatcher import Dispatch, Dispatcher
    from ostinato.errors import (
        CaptureNotAllowedError,
        GraphCaptureError,
        InputAddressChangedError,
        OstinatoError,
        PlatformError,
    )
    from ostinato.graph import GraphEntry, GraphOptions, GraphWrapper
    from ostinato.guard import capture_phase, in_capture_phase
    from ostinato.manager import GraphManager
    from ostinato.modes import GraphMode
    from ostinato.param_updates import UpdateOrder
    from ostinato.platform import current_platform, use_platform
    from ostinato.pool import shared_pool
    from ostinato.replay_check import GraphDemotedWarning, ReplayCheck
    from ostinato.replay_stats import BucketStats, EagerReason, StatsSnapshot
    from ostinato.resolution import AttentionGraphSupport, ModeResolution, resolve_mode
    from ostinato.runtime import GraphRuntime, auto_mode, build_graph_runtime, choose_compiler
    from ostinato.staged import StagedRuntime


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'ostinato' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
