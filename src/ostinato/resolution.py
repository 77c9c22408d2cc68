"""Attention-backend graph support levels and the mode downgrades they force."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from ostinato.modes import GraphMode

logger = logging.getLogger(__name__)


class AttentionGraphSupport(enum.IntEnum):
    """How much of a step an attention backend can run inside one full graph.

    Ordered: a higher level supports everything a lower one does.
    """

    NEVER = 0
    """Attention cannot be captured at all: it must run eagerly between pieces."""
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Only batches where every request decodes exactly one token."""
    UNIFORM_BATCH = 2
    """Only batches where every request has the same query length (e.g. spec decode)."""
    ALWAYS = 3
    """Any batch, mixed prefill and decode included."""


@dataclass(frozen=True)
class ModeResolution:
    """The mode a runner will actually use, and why it differs from the one asked for.

    ``reasons`` is empty exactly when ``mode == requested``.
    """

    requested: GraphMode
    mode: GraphMode
    reasons: tuple[str, ...] = ()


def resolve_mode(
    requested: GraphMode,
    support: AttentionGraphSupport = AttentionGraphSupport.ALWAYS,
    *,
    piecewise_available: bool = True,
    platform_has_graphs: bool = True,
    uniform_decode_query_len: int = 1,
) -> ModeResolution:
    """Downgrades ``requested`` to the strongest mode the backend and platform allow.

    Guarantees: never upgrades; never returns a mode with FULL graphs for batches the
    backend cannot capture; never returns PIECEWISE when ``piecewise_available`` is false.
    Every downgrade is logged as a warning with its reason (no silent fallback).
    """
    mode = requested
    reasons: list[str] = []

    def downgrade(new: GraphMode, why: str) -> None:
        nonlocal mode
        if new is not mode:
            reasons.append(f"{mode.name} -> {new.name}: {why}")
            mode = new

    if not platform_has_graphs:
        downgrade(GraphMode.NONE, "the platform has no graph support; everything runs eagerly")
    if mode.has_piecewise_graphs() and not piecewise_available:
        why = "piecewise graphs need the model compiled with the ostinato backend"
        downgrade(
            GraphMode.FULL_DECODE_ONLY if mode.decode_mode() is GraphMode.FULL else GraphMode.NONE,
            why,
        )
    if mode.has_full_graphs() and support is AttentionGraphSupport.NEVER:
        why = "the attention backend cannot run inside a full graph"
        fallback = GraphMode.PIECEWISE if piecewise_available else GraphMode.NONE
        if mode is GraphMode.FULL_DECODE_ONLY:
            fallback = GraphMode.NONE
        downgrade(fallback, why)
    if mode.mixed_mode() is GraphMode.FULL and support < AttentionGraphSupport.ALWAYS:
        why = f"attention supports full graphs only for uniform batches ({support.name})"
        downgrade(
            GraphMode.FULL_AND_PIECEWISE if piecewise_available else GraphMode.FULL_DECODE_ONLY,
            why,
        )
    if (
        mode.decode_mode() is GraphMode.FULL
        and support is AttentionGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
        and uniform_decode_query_len > 1
    ):
        why = (
            f"decode steps have {uniform_decode_query_len} query tokens per request but "
            "attention supports full graphs only for single-token decode"
        )
        downgrade(
            GraphMode.PIECEWISE if mode.mixed_mode() is GraphMode.PIECEWISE else GraphMode.NONE,
            why,
        )
    for r in reasons:
        logger.warning("ostinato: graph mode downgraded %s", r)
    return ModeResolution(requested, mode, tuple(reasons))
