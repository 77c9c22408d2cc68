"""Serving an engine that drives its own worker processes, step by step.

A served engine's scheduler is changed from outside between steps: requests are added,
aborted, or the whole scheduler is reset. Under tensor parallelism every rank runs its
own scheduler, and the ranks' collectives pair up only while those schedulers stay
identical. ``StepMirror`` (rank 0) records each outside change and sends the changes
made since the last step to every worker with the command to run the next step;
``StepFollower`` (a worker) applies them and runs its step.

Guarantee: every worker's scheduler receives the same changes, in the same order,
between the same steps as rank 0's. The ranks share the sampling seed, so they then
schedule and sample the same tokens, step for step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ostinato.engine.core.lora_slots import LoraAdapter
from ostinato.engine.core.params import SamplingParams
from ostinato.engine.core.scheduler import Request, Scheduler


@dataclass(frozen=True)
class Added:
    """``Scheduler.add(prompt, params)``; the request it makes gets the same id on every
    rank (the schedulers count ids alike)."""

    prompt: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Aborted:
    """``Scheduler.abort`` of the requests with these ids."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class Reset:
    """``Scheduler.reset()``."""


SchedulerChange = Added | Aborted | Reset

STEP = "step"  # the command: apply the changes, then run one step
END = "end_steps"  # the command: apply the changes, then drop the step iterator


class StepMirror:
    """The scheduler of a served engine, changed between steps, and its steps.

    ``add``, ``abort`` and ``reset`` change the scheduler; ``steps()`` runs it. With
    ``send`` (rank 0 of an engine with worker processes), every change is recorded and
    leaves, as ``send(STEP, changes)``, just before the step that follows it; ``end``
    sends what is left (``send(END, changes)``) when serving stops, so a later
    ``generate`` starts from the same state on every rank. Without ``send`` (one
    process, or a worker following rank 0) nothing is recorded.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        new_steps: Callable[[], Iterator[None]],
        send: Callable[[str, list[SchedulerChange]], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self._new_steps = new_steps
        self._send = send
        self._changes: list[SchedulerChange] = []

    def add(
        self, prompt: list[int], params: SamplingParams, lora: LoraAdapter | None = None
    ) -> Request:
        if lora is not None and self._send is not None:
            raise ValueError("lora: not with worker processes (tensor parallelism)")
        request = self.scheduler.add(prompt, params, lora)
        self._record(Added(list(prompt), params))
        return request

    def abort(self, requests: list[Request]) -> None:
        requests = [r for req in requests for r in req.group]  # (as the scheduler ends them)
        live = tuple(r.id for r in requests if not r.finished)
        self.scheduler.abort(requests)
        if live:
            self._record(Aborted(live))

    def reset(self) -> None:
        self.scheduler.reset()
        self._record(Reset())

    def steps(self) -> Iterator[None]:
        """The engine's steps until no request is left, each announced to the workers
        (with the changes made before it) just before it runs."""
        inner = self._new_steps()
        if self._send is None:
            return inner
        return self._announced(inner)

    def end(self) -> None:
        """Sends the changes not yet sent; the workers drop their step iterators."""
        self._flush(END)

    def _announced(self, inner: Iterator[None]) -> Iterator[None]:
        while True:
            self._flush(STEP)
            try:
                next(inner)
            except StopIteration:
                return
            yield

    def _record(self, change: SchedulerChange) -> None:
        if self._send is not None:
            self._changes.append(change)

    def _flush(self, command: str) -> None:
        if self._send is not None:
            changes, self._changes = self._changes, []
            self._send(command, changes)


class StepFollower:
    """A worker's side: ``follow(command, changes)`` makes rank 0's changes through
    ``session`` (a ``StepMirror`` without ``send``), then runs one step (of a new step
    iterator when the last one ended) or, for ``END``, drops the iterator."""

    def __init__(self, session: StepMirror) -> None:
        self.session = session
        self._steps: Iterator[None] | None = None

    def follow(self, command: str, changes: list[SchedulerChange]) -> None:
        for change in changes:
            apply_change(self.session, change)
        if command == END:
            self._steps = None
            return
        if self._steps is None:
            self._steps = self.session.steps()
        try:
            next(self._steps)
        except StopIteration:
            self._steps = None


def apply_change(session: StepMirror, change: SchedulerChange) -> None:
    """Makes ``change`` on a worker's scheduler as rank 0 made it on its own."""
    if isinstance(change, Added):
        session.add(change.prompt, change.params)
    elif isinstance(change, Aborted):
        ids, scheduler = set(change.ids), session.scheduler
        session.abort([r for r in (*scheduler.running, *scheduler.waiting) if r.id in ids])
    else:
        session.reset()
