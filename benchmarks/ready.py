"""Engines built for timing: every graph captured before the first timed step."""

from __future__ import annotations

from typing import Any


def ready(llm: Any, timeout_s: float = 600.0) -> Any:
    """``llm`` once its background capture (``capture="auto"``'s choice on one GPU) has
    ended, every graph and sampling graph in place; ``RuntimeError`` if it failed or
    outlasted ``timeout_s``: a benchmark times the graphs, not a capture in progress."""
    if not llm.wait_for_graphs(timeout=timeout_s):
        raise RuntimeError(f"graphs not ready: {llm.background.summary()}")
    return llm
