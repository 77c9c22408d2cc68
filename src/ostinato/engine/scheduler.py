"""Continuous batching: admit prefills, run decodes, preempt when KV blocks run out."""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

from ostinato.engine.kv_cache import BlockPool, blocks_needed
from ostinato.engine.sampler import SamplingParams


class FinishReason(enum.Enum):
    """Why a request stopped: a stop or EOS token, or a length limit."""

    STOP = "stop"
    LENGTH = "length"


@dataclass
class Request:
    """A prompt and its generation so far. ``num_cached`` tokens have K/V in ``blocks``."""

    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by the tokens generated so far."""
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass
class ScheduledRequest:
    """One request's part of a step: ``tokens`` at positions ``start ..``."""

    request: Request
    tokens: list[int]
    start: int


@dataclass
class Step:
    """What one model step runs. ``uniform_decode``: every request decodes one token."""

    scheduled: list[ScheduledRequest]

    @property
    def num_tokens(self) -> int:
        """Tokens the step runs, over all requests."""
        return sum(len(s.tokens) for s in self.scheduled)

    @property
    def uniform_decode(self) -> bool:
        """True when every request decodes exactly one token."""
        return all(len(s.tokens) == 1 for s in self.scheduled)


class Scheduler:
    """First-come-first-served continuous batching over a paged KV cache.

    Guarantees: a request is never lost: it is waiting, running or finished. Prompts
    are prefilled whole; running requests decode one token per step; when a decode needs
    a block and none is free, the most recently admitted running request is preempted
    (its blocks freed, to be recomputed later from prompt + output so far). Requests
    that could never fit raise ``ValueError`` at ``add``; requests that merely do not
    fit now wait.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_id: int | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()

    def add(self, prompt: list[int], params: SamplingParams) -> Request:
        """Queues a request; raises ``ValueError`` (see ``check``) if it could never run."""
        self.check(prompt)
        req = Request(next(self._ids), list(prompt), params)
        self.waiting.append(req)
        return req

    def check(self, prompt: list[int]) -> None:
        """Raises ``ValueError`` naming the limit if ``prompt`` could never be scheduled."""
        if not prompt:
            raise ValueError("prompt: empty; give at least one token")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}; shorten it or raise max_model_len"
            )
        if len(prompt) > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt: {len(prompt)} tokens exceed max_num_batched_tokens="
                f"{self.max_num_batched_tokens}; raise the token budget"
            )
        if blocks_needed(len(prompt) + 1, self.block_size) > self.pool.num_blocks - 1:
            raise ValueError(
                f"prompt: needs more KV blocks than the cache has ({self.pool.num_blocks - 1}); "
                "give the engine more blocks"
            )

    @property
    def has_work(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        """The next step: every running decode that fits, then new prefills."""
        scheduled: list[ScheduledRequest] = []
        budget = self.max_num_batched_tokens
        # Decodes first: each running request needs room for one more token.
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted below to make room for an earlier request
            if not self._reserve(req, req.num_cached + 1):
                continue
            scheduled.append(ScheduledRequest(req, [req.tokens[-1]], req.num_cached))
            budget -= 1
        # Then admit waiting requests while tokens, sequences and blocks allow.
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            tokens = req.tokens
            if len(tokens) > budget:
                break
            need = blocks_needed(len(tokens), self.block_size)
            if need > self.pool.num_free:
                break
            self.waiting.popleft()
            req.blocks = self.pool.allocate(need)
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, tokens, 0))
            budget -= len(tokens)
        return Step(scheduled)

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Makes ``req`` hold blocks for ``num_tokens``, preempting others if needed.

        Returns False if ``req`` itself had to be preempted.
        """
        need = blocks_needed(num_tokens, self.block_size) - len(req.blocks)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.blocks += self.pool.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.free(req.blocks)
        req.blocks, req.num_cached = [], 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, step: Step, sampled: list[int]) -> list[Request]:
        """Records one sampled token per scheduled request; returns those that finished."""
        done = []
        for s, token in zip(step.scheduled, sampled, strict=True):
            req = s.request
            req.num_cached = s.start + len(s.tokens)
            req.output.append(token)
            p = req.params
            if (not p.ignore_eos and token == self.eos_token_id) or token in p.stop_token_ids:
                req.finish_reason = FinishReason.STOP
            elif len(req.output) >= p.max_tokens or len(req.tokens) >= self.max_model_len:
                req.finish_reason = FinishReason.LENGTH
            if req.finished:
                self.running.remove(req)
                self.pool.free(req.blocks)
                req.blocks = []
                done.append(req)
        return done
