"""The verify-ahead loop: speculative decoding whose greedy verify steps overlap like
plain decodes under asynchronous scheduling. It is a loop of its own over the engine's
``StepLoop``, used only with a proposer that drafts before a verify step's outcome is
known (the oracle) and ``async_scheduling``; the runner completes such steps on the
device with ``spec.lookahead.VerifyLookahead``, given to it as its decode hook."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ostinato.engine.core.scheduler import ScheduledBatch
from ostinato.engine.sample.verify import accept_greedy
from ostinato.engine.worker.step_loop import StepLoop


@dataclass(frozen=True)
class VerifyOnDevice:
    """A greedy verify step on the device, its acceptance kept there for the step
    scheduled ahead of it (``spec.lookahead``): the host copy of its argmax (``host``,
    one per row) and the event that marks that copy done (None on the CPU)."""

    step: ScheduledBatch
    host: torch.Tensor
    done: torch.cuda.Event | None


class VerifyAheadLoop:
    """Steps of a speculative engine over ``loop``, verify steps scheduled ahead where
    they can be (``steps``). Guarantees: outputs are the synchronous engine's; the host
    waits once per step, for the tokens of the step before."""

    def __init__(self, loop: StepLoop) -> None:
        self.loop = loop

    def steps(self) -> Iterator[None]:
        """Speculative decoding with lookahead: while verify step N runs, step N+1 (the
        same requests, each drafting after whatever N accepts) is scheduled, staged and
        queued; the device picks its input ids and positions by N's accepted counts, so
        the host's work hides behind the device's as in ``async_steps``, and outputs are
        the synchronous engine's. A step that cannot be scheduled blind
        (``Scheduler.schedule_ahead``: a request arriving, a sampled request, a short
        draft, no free block for the worst case) runs synchronously, and lookahead
        resumes at the next greedy verify step. Yields after each step's tokens are in."""
        inflight: VerifyOnDevice | None = None
        while self.loop.scheduler.has_work or inflight is not None:
            if inflight is None:
                step = self.loop.scheduler.schedule()
                if not step.scheduled:
                    raise RuntimeError("scheduler produced an empty step with work pending")
                if self._verifies_ahead(step):
                    inflight = self.launch_verify(step, scheduled_ahead=False)
                else:
                    launched = self.loop.launch(step)
                    if launched is not None:
                        self.loop.resolve(launched)
                yield
                continue
            ahead = self.loop.scheduler.schedule_ahead(inflight.step)
            following = (
                self.launch_verify(ahead, scheduled_ahead=True) if ahead is not None else None
            )
            self.settle(inflight, following)
            inflight = following
            yield

    def _verifies_ahead(self, step: ScheduledBatch) -> bool:
        """Whether ``step`` can be verified on the device (and the next one scheduled
        while it runs): a lookahead proposer, every request greedy with a full draft,
        and a runner that completes such steps at this size."""
        k = self.loop.scheduler.num_speculative
        return (
            self.loop.scheduler.lookahead is not None
            and step.uniform_decode
            and all(len(s.draft) == k and s.request.params.greedy for s in step.scheduled)
            and self.loop.runner.verifies_ahead(step.num_tokens)
        )

    def launch_verify(self, step: ScheduledBatch, scheduled_ahead: bool) -> VerifyOnDevice:
        """Queues greedy verify ``step`` and starts copying its argmax back. A step
        ``scheduled_ahead`` is completed on the device by the outcome of the verify step
        before it, and marked launched when that one is settled."""
        greedy = self.loop.runner.execute(step).greedy
        if greedy is None:
            raise RuntimeError("a verify step ran without its argmax: not a uniform decode step")
        if not scheduled_ahead:
            self.loop.scheduler.launched(step)
        host, done = self.loop.copy_back(greedy[: step.num_tokens])
        if scheduled_ahead:
            self.loop.spec_stats.ahead_steps += 1
        return VerifyOnDevice(step, host, done)

    def settle(self, launched: VerifyOnDevice, following: VerifyOnDevice | None) -> None:
        """Waits for ``launched``'s tokens, records them, and fills in ``following`` (the
        step scheduled ahead of it, already on the device)."""
        self.loop.wait_copy(launched.done)
        got = accept_greedy(launched.step, launched.host.tolist())
        self.loop.count(launched.step, got)
        self.loop.scheduler.resolve(launched.step, got)
        if following is not None:
            self.loop.scheduler.settle_ahead(following.step, launched.step, got)
