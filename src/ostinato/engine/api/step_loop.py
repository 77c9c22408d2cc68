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
from ostinato.engine.sample.logprobs import StepLogprobs
from ostinato.engine.sample.step_sampler import StepOutput, StepSampler
from ostinato.engine.spec.speculative import SpeculativeStats
from ostinato.engine.worker.inputs import PreviousSample
from ostinato.engine.worker.runner import ModelRunner
from ostinato.ubatch.slicing import can_split


@dataclass(frozen=True)
class InFlight:
    """A step on the device: its batch, its sampled tokens (device), their host copy
    (pinned, filled asynchronously), the host copy of their log probabilities where a
    request asked, and the event that marks the copies done (None on the CPU, where
    they are done already)."""

    step: ScheduledBatch
    sampled: PreviousSample
    host: torch.Tensor
    done: torch.cuda.Event | None
    resolved: list[int | list[int]] | None = None  # a verify step's tokens, already known
    logprobs: StepLogprobs | None = None


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
        # Where sampled tokens land on the host, with the events that mark each copy
        # done: two of each, used in turn (step N+1 is launched before step N's tokens
        # are read, and step N+2 after), made once. A copy into a new tensor allocated
        # pinned memory and an event every step.
        self._landing: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        if self.device.type == "cuda":
            rows = scheduler.max_num_seqs
            self._landing = [
                (torch.empty(rows, dtype=torch.long, pin_memory=True), torch.cuda.Event())
                for _ in range(2)
            ]
        self._turn = 0
        # The log probabilities' landings, one a turn as the tokens' (``_logprobs_back``).
        self._logprob_landing: list[StepLogprobs | None] = [None, None]
        # Where a launched step's tokens wait for the next step (its decodes gather
        # them on the device): sampled tokens may be a view of a sampling graph's output,
        # in the pool every graph shares, and work between two steps may replay a graph
        # whose intermediates share that memory (a recapture timing the graph it would
        # replace: an early graph's intermediates overlap outputs captured after it).
        self._carry = torch.empty(scheduler.max_num_seqs, dtype=torch.long, device=self.device)

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

    def copy_back(
        self, tokens: torch.Tensor, logprobs: StepLogprobs | None = None
    ) -> tuple[torch.Tensor, StepLogprobs | None, torch.cuda.Event | None]:
        """Starts copying ``tokens`` (and ``logprobs``) to the host; the event marks it
        done (None: done). On CUDA the host tensors (the tokens', the log probabilities')
        and the event are reused by the copy after next: read them (``resolve``) before
        launching two more steps."""
        if self.device.type == "cuda":
            self._turn ^= 1
            host_logprobs = None if logprobs is None else self._logprobs_back(logprobs)
            landing, done = self._landing[self._turn]
            if tokens.dtype == landing.dtype and tokens.shape[0] <= landing.shape[0]:
                host = landing[: tokens.shape[0]]
                host.copy_(tokens, non_blocking=True)
            else:
                host = tokens.to("cpu", non_blocking=True)
            done.record()
            return host, host_logprobs, done
        # A copy, always: ``tokens`` may be a view of a graph's static output, which
        # the next step's replay overwrites before this step is resolved.
        host_logprobs = None if logprobs is None else logprobs.to_host()
        return tokens.to("cpu", copy=True), host_logprobs, None

    def _logprobs_back(self, logprobs: StepLogprobs) -> StepLogprobs:
        """``logprobs`` copied into this turn's pinned landing (made at the first step
        that asks, and again where a step's columns or types differ)."""
        landing = self._logprob_landing[self._turn]
        if landing is None or not landing.fits(logprobs):
            rows = max(self.scheduler.max_num_seqs, logprobs.chosen.shape[0])
            landing = self._logprob_landing[self._turn] = logprobs.landing(rows)
        return logprobs.to_host(into=landing)

    def carried(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (one per request of a step) copied into the loop's own buffer,
        queued on the device; nothing but the next step's copy writes there (a copy of
        their own where they outnumber its rows)."""
        if tokens.shape[0] > self._carry.shape[0]:
            return tokens.clone()
        kept = self._carry[: tokens.shape[0]]
        kept.copy_(tokens)
        return kept

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

    def count(self, step: ScheduledBatch, got: list[int | list[int]]) -> None:
        """Adds ``step``'s verified drafts to ``spec_stats``: drafted, accepted (the tokens
        ``got`` beyond the one a target step makes anyway) and verifications."""
        stats = self.spec_stats
        for s, tokens in zip(step.scheduled, got, strict=True):
            if s.draft and isinstance(tokens, list):
                stats.drafted += len(s.draft)
                stats.accepted += len(tokens) - 1
                stats.verifications += 1
                stats.tokens += len(tokens)

    def step(self) -> list[Request] | None:
        """One step: schedule, execute and sample (``launch``), resolve (the step's one
        wait, for its tokens); returns the requests that finished (None: see
        ``schedule``)."""
        scheduled = self.schedule()
        if scheduled is None:
            return None
        launched = self.launch(*scheduled)  # executed and sampled on the device
        return [] if launched is None else self.resolve(launched)

    def schedule(self) -> tuple[ScheduledBatch, StepAgreement | None] | None:
        """The next step and, under data parallelism, what the replicas agreed it runs
        as. None when no replica had work: the step's one collective, the agreement, also
        tells the replicas when all are done; a replica without work runs a dummy step."""
        group = self.parallel.dp_group
        if group is None or self.scheduler.has_work:
            step = self.scheduler.schedule()
            if not step.scheduled:
                raise RuntimeError("scheduler produced an empty step with work pending")
        else:
            step = ScheduledBatch([])
        if group is None:
            return step, None
        micro = False
        if step.scheduled:
            local = self.runner.graphs.dispatch(step.num_tokens, step.uniform_decode)
            mode, padded, uniform = local.mode, local.padded_tokens, step.uniform_decode
            micro = self.runner.ubatch.applies(mode, padded, step)
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
        return None if agreement.num_tokens == 0 else (step, agreement)

    def launch(
        self,
        step: ScheduledBatch,
        agreement: StepAgreement | None = None,
        previous: InFlight | None = None,
    ) -> InFlight | None:
        """Queues ``step`` and its sampling on the device and starts copying the tokens
        back; returns without waiting (None for a dummy step, which samples nothing).
        Holds the step's turn throughout: a background capture writes dummy inputs into
        the same buffers, and the sampler reads the step's outputs."""
        with self.runner.stepping():
            if self.speculative:  # (its drafts are verified: no sampling values to make)
                out = self.runner.execute(step, agreement, previous and previous.sampled)
                return self._verified(step, out) if step.scheduled else None
            # The penalties' counts take the last step's tokens before this step's graphs
            # run: those tokens may sit in a sampling graph's output, which shares the
            # pool with the step's graphs and so may be overwritten by their replay.
            last = None if previous is None else (previous.sampled.tokens, previous.sampled.index)
            params = [s.request.params for s in step.scheduled]
            # the index of each token drawn, which a seeded request's draws depend on
            indices = [s.start + len(s.tokens) for s in step.scheduled]
            counts = self.sampler.output_counts(step.scheduled, last)
            self.sampler.prepare(params, indices, counts)  # (queued before the step)
            out = self.runner.execute(step, agreement, previous and previous.sampled)
            if not step.scheduled:
                return None
            tokens = self.sampler.tokens(params, out, indices, counts)
            logprobs = self.sampler.logprobs(params, out, tokens)
            self.scheduler.launched(step)
            index = {s.request.id: i for i, s in enumerate(step.scheduled) if s.samples}
            tokens = self.carried(tokens)
            host, host_logprobs, done = self.copy_back(tokens, logprobs)
        return InFlight(step, PreviousSample(tokens, index), host, done, None, host_logprobs)

    def _verified(self, step: ScheduledBatch, out: StepOutput) -> InFlight:
        """A speculative engine's step, resolved at once: drafts verified, tokens kept."""
        got = self.sampler.verify(step, out)
        self.scheduler.launched(step)
        self.count(step, got)
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
        tokens = launched.host.tolist()
        logprobs = launched.logprobs
        if logprobs is None:
            return self.scheduler.resolve(launched.step, tokens)
        params = [s.request.params for s in launched.step.scheduled]
        return self.scheduler.resolve(launched.step, tokens, logprobs.entries(params, tokens))
