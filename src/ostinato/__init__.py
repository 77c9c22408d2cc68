"""ostinato: capture PyTorch models as CUDA graphs and replay them for any batch size.

The public API, by layer (see docs/design.md): modes and configuration (``GraphMode``,
``GraphConfig``, ``BatchDescriptor``, ``Dispatcher``, ``forward_context``), graphs
(``GraphWrapper``, ``capture_phase``, ``shared_pool``), and runner pieces
(``GraphManager``, and ``build_graph_runtime``, the one entry point that wires them).
"""

from ostinato.batch import BatchDescriptor
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
from ostinato.manager import CaptureItem, GraphManager
from ostinato.modes import GraphMode
from ostinato.platform import current_platform, use_platform
from ostinato.pool import shared_pool
from ostinato.resolution import AttentionGraphSupport, ModeResolution, resolve_mode
from ostinato.runtime import GraphRuntime, auto_mode, build_graph_runtime, choose_compiler

__version__ = "0.1.0"

__all__ = [
    "AttentionGraphSupport",
    "BatchDescriptor",
    "CaptureItem",
    "CaptureNotAllowedError",
    "CaptureReport",
    "Dispatch",
    "Dispatcher",
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
    "InputAddressChangedError",
    "ModeResolution",
    "OstinatoError",
    "PlatformError",
    "auto_mode",
    "build_graph_runtime",
    "capture_phase",
    "choose_compiler",
    "current_forward_context",
    "current_platform",
    "default_capture_sizes",
    "forward_context",
    "get_forward_context",
    "in_capture_phase",
    "resolve_mode",
    "shared_pool",
    "use_platform",
]
