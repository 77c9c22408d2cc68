"""Ops whose parameters are host values, kept current inside captured graphs.

A graph replays its kernels with the arguments they were captured with. Ostinato's own
kernels read a step's lengths from device buffers, so a replay sees each step's values.
Ascend's attention ops take the sequence lengths as host parameters instead, which a
graph would freeze. On such a platform an op captures itself as an *updatable task*:

- During capture, ``capture_updatable(issue, step)`` runs ``issue(step)`` inside a task
  group of the platform, which waits on an event of its own, and registers ``issue``
  with the graph being captured (the registry of that captured descriptor).
- Before a replay, the graph runtime re-issues each registered op with the new step's
  metadata on the platform's update stream (``Platform.update_tasks``), in the order
  the platform's ``update_order`` names.

Guarantees: on a platform whose ``update_order`` is ``NONE`` (CUDA, CPU), or outside a
capture, ``capture_updatable`` is exactly ``issue(step)``: nothing is registered and
nothing is paid at replay. A graph holding updatable tasks is never replayed without its
updates (``GraphWrapper`` refuses a replay that brings no step metadata).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol


class UpdateOrder(enum.Enum):
    """How a platform orders the parameter updates of step i against its replays."""

    NONE = "none"
    """Ops read their parameters from device memory: nothing registers, nothing updates."""
    SYNC_THEN_UPDATE = "sync-then-update"
    """Synchronize the device (step i-1's replay has finished), update, then replay."""
    REPLAY_THEN_UPDATE = "replay-then-update"
    """Launch the replay first, then update on the update stream while it runs: each
    task waits on its event, and the update stream first waits for a fence recorded
    before the launch, so it cannot overtake step i-1's replay. No host synchronize."""


Reissue = Callable[[Any], None]
"""Issues the op again from a step's metadata (the forward context's ``attn_metadata``)."""


class TaskPlatform(Protocol):
    """What the registry needs of a platform (``ostinato.platform.Platform`` has it)."""

    update_order: UpdateOrder

    def capture_task(self, issue: Callable[[], None]) -> tuple[Any, Any]: ...


@dataclass(frozen=True)
class UpdatableTask:
    """One op captured as an updatable task: the platform's task-group ``handle``, the
    external ``event`` the captured group waits on, and how to issue it for a step."""

    name: str
    handle: Any
    event: Any
    reissue: Reissue


@dataclass
class TaskRegistry:
    """The updatable tasks of one captured graph, in capture order."""

    platform: TaskPlatform
    tasks: list[UpdatableTask] = field(default_factory=list)


_recording: ContextVar[TaskRegistry | None] = ContextVar("ostinato_task_registry", default=None)


@contextlib.contextmanager
def recording_tasks(platform: TaskPlatform) -> Iterator[TaskRegistry]:
    """Inside, ``capture_updatable`` registers into the registry yielded (a graph's
    capture on ``platform``); a platform with ``update_order`` NONE records nothing."""
    registry = TaskRegistry(platform)
    if platform.update_order is UpdateOrder.NONE:
        yield registry
        return
    token = _recording.set(registry)
    try:
        yield registry
    finally:
        _recording.reset(token)


def capture_updatable(issue: Reissue, step: Any, *, name: str) -> None:
    """Runs ``issue(step)``; while a graph is captured on a platform that updates
    parameters, as an updatable task of that graph (``name`` appears in errors)."""
    registry = _recording.get()
    if registry is None:
        issue(step)
        return
    handle, event = registry.platform.capture_task(lambda: issue(step))
    registry.tasks.append(UpdatableTask(name, handle, event, issue))


def capturing_tasks() -> bool:
    """True while a graph is captured on a platform that updates parameters: an op about
    to call ``capture_updatable`` may prepare what only a captured task needs (a
    workspace sized for the largest parameters, say)."""
    return _recording.get() is not None
