"""The compile cache: what compiling and tuning produced, reused by the next process.

Three kinds of artifact live under ``<cache root>/compile`` (the model cache's root):

- Inductor's compiled pieces (its FX-graph and AOTAutograd caches, keyed by Inductor
  itself on the graph, torch version, device and config) in ``inductor/``;
- Triton's compiled kernels (keyed by Triton on source, version and device) in
  ``triton/``;
- the measured small-GEMM plans in ``gemm_plans.json``, keyed here by device name and
  compute capability, torch and Triton versions, projection shape and dtype, row counts,
  PDL and the noise margin: a plan measured on one GPU is never used on another.

Inductor and Triton are pointed at their folders through their environment variables,
and only where the user has not set those; the module imports no torch, so an engine's
process points them before its early threads (``api.early_start``) touch Triton's cache.
A plan file that cannot be read is named in a warning and replaced; one that cannot be
written is a warning.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ostinato.cache_root import replace_file

if TYPE_CHECKING:  # torch is not imported here: the early start points the compilers first
    import torch

logger = logging.getLogger(__name__)

COMPILER_DIRS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
PLANS = "gemm_plans.json"


class CompileCache:
    """The compile cache under ``root/compile`` (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.folder = Path(root).expanduser() / "compile"

    def point_compilers_here(self) -> dict[str, str]:
        """Sets Inductor's and Triton's cache folders to ours where the environment does
        not name them already; returns the variables it set."""
        chosen = {}
        for var, sub in COMPILER_DIRS.items():
            if not os.environ.get(var):
                chosen[var] = os.environ[var] = str(self.folder / sub)
        return chosen

    def plan_key(
        self, device: torch.device, shape: Sequence[Any], rows: Sequence[int], extra: str
    ) -> str:
        """The key of one projection's plan: everything the measurement depended on."""
        import torch
        import triton

        props = torch.cuda.get_device_properties(device)
        return json.dumps(
            [
                props.name,
                f"{props.major}.{props.minor}",
                torch.__version__,
                triton.__version__,
                [str(s) for s in shape],
                list(rows),
                extra,
            ]
        )

    def load_plans(self) -> dict[str, list[int]]:
        """Every stored plan by key; empty (with a warning) if the file is unreadable."""
        path = self.folder / PLANS
        if not path.is_file():
            return {}
        try:
            plans = json.loads(path.read_text())
            if not isinstance(plans, dict) or not all(
                isinstance(v, list) and all(isinstance(i, int) for i in v) for v in plans.values()
            ):
                raise ValueError("not a map of plans")
            return plans
        except (OSError, ValueError) as exc:
            logger.warning("ostinato: %s is unreadable (%s); measuring plans again", path, exc)
            return {}

    def store_plans(self, plans: dict[str, list[int]]) -> None:
        """Adds ``plans`` to the file (written to a temporary name, then renamed)."""
        merged = {**self.load_plans(), **plans}
        path = self.folder / PLANS
        try:
            replace_file(path, json.dumps(merged, indent=1))
        except OSError as exc:
            logger.warning("ostinato: cannot write %s (%s); plans are not kept", path, exc)
