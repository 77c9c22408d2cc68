"""The forward context: what the current step is (runtime mode, padded batch, metadata)."""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

import torch

from ostinato.batch import BatchDescriptor
from ostinato.modes import GraphMode


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """The step being run. ``attn_metadata`` is whatever the attention backend needs.

    ``outputs`` is set only while a FULL graph is captured: the first ``num_tokens`` rows
    of the static output buffers, one per step output. A step may write its outputs
    there and return those very views; its replays then copy nothing into the buffers
    (``StaticOutputs.write``). A step that ignores them is copied, as always.
    """

    runtime_mode: GraphMode
    batch_descriptor: BatchDescriptor | None = None
    attn_metadata: Any = None
    outputs: tuple[torch.Tensor, ...] | None = None


_current: ContextVar[ForwardContext | None] = ContextVar("ostinato_forward_context", default=None)


class forward_context:  # lower case: used as a `with` statement, like a function
    """``with forward_context(mode, descriptor, attn_metadata) as ctx:`` sets the step
    (``outputs``: only ``GraphManager``'s FULL captures pass them).

    Guarantees: the previous context (or none) is restored on exit, also on error;
    contexts nest; each thread and asyncio task sees its own (``contextvars``).
    ``mode`` must be a runtime mode (NONE, PIECEWISE or FULL).
    """

    __slots__ = ("context", "_token")

    def __init__(
        self,
        runtime_mode: GraphMode,
        batch_descriptor: BatchDescriptor | None = None,
        attn_metadata: Any = None,
        outputs: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        if not runtime_mode.is_runtime_mode():
            raise ValueError(
                f"runtime_mode: {runtime_mode.name} is not a runtime mode; a step runs as "
                "NONE, PIECEWISE or FULL (use Dispatcher.dispatch to pick one)"
            )
        self.context = ForwardContext(runtime_mode, batch_descriptor, attn_metadata, outputs)
        self._token: Token[ForwardContext | None] | None = None

    def __enter__(self) -> ForwardContext:
        self._token = _current.set(self.context)
        return self.context

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _current.reset(self._token)
        self._token = None


def current_forward_context() -> ForwardContext | None:
    """The context set by the innermost enclosing ``forward_context``, or None."""
    return _current.get()


def get_forward_context() -> ForwardContext:
    """Like ``current_forward_context`` but raises when no step is being run."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "no forward context is set; run the model inside "
            "`with ostinato.forward_context(mode, descriptor):`"
        )
    return ctx
