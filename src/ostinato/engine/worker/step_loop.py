"""The engine's step loop: schedule, launch on the device, read the tokens back, record
them; synchronously (one step at a time, data-parallel agreement included) or
asynchronously (step N+1 prepared while step N runs), with speculative verification."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ostinato.distributed.agreement import StepAgreement, agree_on_step, idle_proposal
from ostinato.distributed.failure import RankFailure, wait_for_device
from ostinato.distributed.groups import ParallelGroups
from ostinato.engine.core.scheduler import Request, ScheduledBatch, Scheduler
from ostinato.engine.sample.step_sampler import StepOutput, StepSampler
from ostinato.engine.sample.verify import accept_greedy
from ostinato.engine.spec.speculative import SpeculativeStats
from ostinato.engine.worker.inputs import PreviousSample
from ostinato.engine.worker.runner import ModelRunner
from ostinato.ubatch.slicing import can_split


@dataclass(frozen=True)
class InFlight:
    """A step on the device: its batch, its sampled tokens (device), their host copy
    (pinned, filled asynchronously) and the event that marks the copy done (None on
    the CPU, where it is done already)."""

    step: ScheduledBatch
    sampled: PreviousSample
    host: torch.Tensor
    done: torch.cuda.Event | None
    resolved: list[int | list[int]] | None = None  # a verify step's tokens, already known


@dataclass(frozen=True)
class VerifyOnDevice:
    """A greedy verify step on the device, its acceptance kept there for the step
    scheduled ahead of it (``engine.lookahead``): the host copy of its argmax (``host``,
    one per row) and the event that marks that copy done (None on the CPU)."""

    step: ScheduledBatch
    host: torch.Tensor
    done: torch.cuda.Event | None


class StepLoop:
    """Drives ``scheduler`` and ``runner`` step by step (the ``LLM``'s engine room).

    Guarantees: the host waits on the device once per step, to read the sampled tokens;
    under tensor or data parallelism that wait is bounded and watches ``peer_failure``.
    ``speculative``: steps verify drafts (and counts go to ``spec_stats``).
    """

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        sampler: StepSampler,
        parallel: ParallelGroups,
        speculative: bool,
        spec_stats: SpeculativeStats,
        peer_failure: Callable[[], RankFailure | None],
    ) -> None:
        self.runner, self.scheduler, self.sampler = runner, scheduler, sampler
        self.parallel, self.device = parallel, runner.device
        self.speculative, self.spec_stats = speculative, spec_stats
        self.peer_failure = peer_failure

    def sync_steps(self) -> Iterator[None]:
        """One step at a time: schedule, run, wait for its tokens. Yields after each."""
        while self.scheduler.has_work or self.parallel.dp_group is not None:
            if self.step() is None:
                return  # every data-parallel replica is out of work
            yield

    def async_steps(self) -> Iterator[None]:
        """Asynchronous scheduling: step N+1 is scheduled, staged and queued while step N
        runs on the device, then step N's tokens are read back, so a decode token costs
        the longer of host and device time rather than their sum. Decodes of step N+1
        take step N's samples on the device. Yields after each step's tokens are in."""
        inflight: InFlight | None = None
        while self.scheduler.has_work or inflight is not None:
            step = self.scheduler.schedule() if self.scheduler.has_work else ScheduledBatch([])
            launched = self.launch(step, previous=inflight) if step.scheduled else None
            if inflight is None and launched is None:
                raise RuntimeError("scheduler produced an empty step with work pending")
            if inflight is not None:
                self.resolve(inflight)
            inflight = launched
            yield

    def speculative_steps(self) -> Iterator[None]:
        """Speculative decoding with lookahead: while verify step N runs, step N+1 (the
        same requests, each drafting after whatever N accepts) is scheduled, staged and
        queued; the device picks its input ids and positions by N's accepted counts, so
        the host's work hides behind the device's as in ``async_steps``, and outputs are
        the synchronous engine's. A step that cannot be scheduled blind
        (``Scheduler.schedule_ahead``: a request arriving, a sampled request, a short
        draft, no free block for the worst case) runs synchronously, and lookahead
        resumes at the next greedy verify step. Yields after each step's tokens are in."""
        inflight: VerifyOnDevice | None = None
        while self.scheduler.has_work or inflight is not None:
            if inflight is None:
                step = self.scheduler.schedule()
                if not step.scheduled:
                    raise RuntimeError("scheduler produced an empty step with work pending")
                if self._verifies_ahead(step):
                    inflight = self.launch_verify(step, scheduled_ahead=False)
                else:
                    launched = self.launch(step)
                    if launched is not None:
                        self.resolve(launched)
                yield
                continue
            ahead = self.scheduler.schedule_ahead(inflight.step)
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
        k = self.scheduler.num_speculative
        return (
            self.scheduler.lookahead is not None
            and step.uniform_decode
            and all(len(s.draft) == k and s.request.params.greedy for s in step.scheduled)
            and self.runner.verifies_ahead(step.num_tokens)
        )

    def launch_verify(self, step: ScheduledBatch, scheduled_ahead: bool) -> VerifyOnDevice:
        """Queues greedy verify ``step`` and starts copying its argmax back. A step
        ``scheduled_ahead`` is completed on the device by the outcome of the verify step
        before it, and marked launched when that one is settled."""
        greedy = self.runner.execute(step).greedy
        if greedy is None:
            raise RuntimeError("a verify step ran without its argmax: not a uniform decode step")
        if not scheduled_ahead:
            self.scheduler.launched(step)
        host, done = self._copy_back(greedy[: step.num_tokens])
        if scheduled_ahead:
            self.spec_stats.ahead_steps += 1
        return VerifyOnDevice(step, host, done)

    def settle(self, launched: VerifyOnDevice, following: VerifyOnDevice | None) -> None:
        """Waits for ``launched``'s tokens, records them, and fills in ``following`` (the
        step scheduled ahead of it, already on the device)."""
        self.wait_copy(launched.done)
        got = accept_greedy(launched.step, launched.host.tolist())
        self._count(launched.step, got)
        self.scheduler.resolve(launched.step, got)
        if following is not None:
            self.scheduler.settle_ahead(following.step, launched.step, got)

    def _copy_back(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Starts copying ``tokens`` to the host; the event marks it done (None: done)."""
        if self.device.type == "cuda":
            host = tokens.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return host, done
        # A copy, always: ``tokens`` may be a view of a graph's static output, which
        # the next step's replay overwrites before this step is resolved.
        return tokens.to("cpu", copy=True), None

    def wait_copy(self, done: torch.cuda.Event | None) -> None:
        """Waits for a copy back; under tensor or data parallelism the wait is bounded
        and watches the peers (a collective inside a graph waits forever for a dead
        peer)."""
        if done is None:
            return
        if self.parallel.world_size > 1:
            wait_for_device(done, self.peer_failure, self.parallel.rank, self.parallel.timeout_s)
        else:
            done.synchronize()

    def _count(self, step: ScheduledBatch, got: list[int | list[int]]) -> None:
        stats = self.spec_stats
        for s, tokens in zip(step.scheduled, got, strict=True):
            if s.draft and isinstance(tokens, list):
                stats.drafted += len(s.draft)
                stats.accepted += len(tokens) - 1
                stats.verifications += 1
                stats.tokens += len(tokens)

    def step(self) -> list[Request] | None:
        """Runs one scheduled step and waits for its tokens; returns the requests that
        finished. None when, under data parallelism, no replica had work: the step's one
        collective, the agreement, also tells the replicas when all are done; a replica
        without work runs a dummy step."""
        group = self.parallel.dp_group
        if group is None or self.scheduler.has_work:
            step = self.scheduler.schedule()
            if not step.scheduled:
                raise RuntimeError("scheduler produced an empty step with work pending")
        else:
            step = ScheduledBatch([])
        agreement = None
        if group is not None:
            micro = False
            if step.scheduled:
                local = self.runner.graphs.dispatch(step.num_tokens, step.uniform_decode)
                mode, padded, uniform = local.mode, local.padded_tokens, step.uniform_decode
                micro = self.runner.would_micro_batch(mode, padded, step)
            else:
                mode, padded, uniform = idle_proposal()
            agreement = agree_on_step(
                mode,
                padded,
                group,
                uniform,
                micro_batch=micro,
                real_tokens=step.num_tokens,
                can_split=can_split,
            )
            if agreement.num_tokens == 0:
                return None
        launched = self.launch(step, agreement)
        return [] if launched is None else self.resolve(launched)

    def launch(
        self,
        step: ScheduledBatch,
        agreement: StepAgreement | None = None,
        previous: InFlight | None = None,
    ) -> InFlight | None:
        """Queues ``step`` and its sampling on the device and starts copying the tokens
        back; returns without waiting (None for a dummy step, which samples nothing)."""
        out = self.runner.execute(step, agreement, previous and previous.sampled)
        if not step.scheduled:
            return None
        if self.speculative:
            return self._verified(step, out)
        tokens = self.sampler.tokens([s.request.params for s in step.scheduled], out)
        self.scheduler.launched(step)
        index = {s.request.id: i for i, s in enumerate(step.scheduled) if s.samples}
        host, done = self._copy_back(tokens)
        return InFlight(step, PreviousSample(tokens, index), host, done)

    def _verified(self, step: ScheduledBatch, out: StepOutput) -> InFlight:
        """A speculative engine's step, resolved at once: drafts verified, tokens kept."""
        got = self.sampler.verify(step, out)
        self.scheduler.launched(step)
        self._count(step, got)
        empty = torch.empty(0, dtype=torch.long)
        return InFlight(step, PreviousSample(empty, {}), empty, None, got)

    def resolve(self, launched: InFlight) -> list[Request]:
        """Waits for ``launched``'s tokens (the step's one synchronisation), records them
        and returns the requests that finished. Under tensor or data parallelism the
        wait is bounded and watches the peers (a collective inside a graph waits forever
        for a dead peer)."""
        if launched.resolved is not None:
            return self.scheduler.resolve(launched.step, launched.resolved)
        self.wait_copy(launched.done)
        return self.scheduler.resolve(launched.step, launched.host.tolist())
