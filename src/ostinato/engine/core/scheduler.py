"""Continuous batching: admit prefills (in chunks when the token budget is short), run
decodes, preempt when KV blocks run out."""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ostinato.engine.core.kv_cache import BlockPool, blocks_needed
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.logprob import TokenLogprob
from ostinato.engine.core.lora_slots import LoraAdapter, LoraLoad, LoraSlots
from ostinato.engine.core.params import SamplingParams
from ostinato.engine.core.stop_text import Decode, StopText


class FinishReason(enum.Enum):
    """Why a request stopped: an EOS or stop token, ``max_tokens``, ``max_model_len``, or
    an abort by its caller (``serve.loop.EngineLoop.abort``)."""

    STOP = "stop"
    LENGTH = "length"
    MAX_MODEL_LEN = "max_model_len"
    ABORT = "abort"


@dataclass(eq=False)  # identity: the scheduler's lists hold each request once
class Request:
    """A prompt and its generation so far. ``num_cached`` tokens have K/V in ``blocks``.
    ``num_pending`` (0 or 1): a token sampled by a step still on the device, counted in
    ``num_tokens`` but not yet in ``output`` (asynchronous scheduling). A ``blocks``
    list only grows; any other change gives the request a new list (the step inputs
    stage only what a list gained since they last saw it)."""

    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_pending: int = 0
    stop_text: StopText | None = None  # its stop strings, where it has any
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if asked
    # The samples of a prompt asked ``n`` times: the first one (``leader``) holds the
    # others; each other one reads the leader's full prompt blocks (``Scheduler._shared``).
    others: list[Request] = field(default_factory=list)
    leader: Request | None = None
    # The LoRA adapter it runs with (None: the base model), and the device slot holding
    # it while the request runs (-1 otherwise).
    lora: LoraAdapter | None = None
    lora_slot: int = -1

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (pending included), without building the list."""
        return len(self.prompt) + len(self.output) + self.num_pending

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by the tokens generated so far."""
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None

    @property
    def group(self) -> list[Request]:
        """This request and the other samples it leads (none for most requests)."""
        return [self, *self.others]

    @property
    def all_finished(self) -> bool:
        """True once this request and every sample it leads have finished."""
        return all(r.finished for r in self.group)


Proposal = Callable[[list["Request"], list[int]], Sequence[Sequence[int]]]
"""Speculative decoding's proposer: for each request, up to ``n[i]`` tokens likely to
follow it (all requests of a step in one call, so a draft model runs them as a batch)."""

PENDING_TOKEN = 0
"""Stands in ``ScheduledRequest.tokens`` for a token still on the device."""


@dataclass(slots=True)  # (one per request per step)
class ScheduledRequest:
    """One request's part of a step: ``tokens`` at positions ``start ..``.

    ``samples`` is False for a chunk that ends before the request's last token (a prefill
    split over steps): its logits are computed but no token is drawn.
    ``from_previous``: a decode whose one input token is the previous step's sample for
    this request, still on the device (``tokens`` holds ``PENDING_TOKEN``).
    ``draft``: proposed next tokens (speculative decoding): ``tokens`` is the request's
    last token followed by ``draft``, and the step verifies them.
    """

    request: Request
    tokens: list[int]
    start: int
    samples: bool = True
    from_previous: bool = False
    draft: list[int] = field(default_factory=list)


@dataclass
class ScheduledBatch:
    """What one model step runs. ``uniform_decode``: every request decodes one token.
    ``lora_loads``: adapters to write into their device slots before it runs."""

    scheduled: list[ScheduledRequest]
    lora_loads: list[LoraLoad] = field(default_factory=list)

    @property
    def has_lora(self) -> bool:
        """Whether any of its requests runs with a LoRA adapter."""
        return any(s.request.lora_slot >= 0 for s in self.scheduled)

    @property
    def num_tokens(self) -> int:
        """Tokens the step runs, over all requests."""
        return sum(len(s.tokens) for s in self.scheduled)

    @property
    def uniform_decode(self) -> bool:
        """True when every request decodes (its last token, plus its draft when
        speculating) and all have the same query length."""
        lens = {len(s.tokens) for s in self.scheduled}
        return len(lens) <= 1 and all(len(s.tokens) == 1 + len(s.draft) for s in self.scheduled)


class Scheduler:
    """First-come-first-served continuous batching over a paged KV cache.

    Guarantees: a request is never lost: it is waiting, running or finished (or
    aborted, which frees it). A request is admitted when the KV blocks for all its tokens
    are free; its tokens are computed in chunks of at most the step's remaining token
    budget, so a prompt, or a preempted request's prompt + output, longer than
    ``max_num_batched_tokens`` still runs. Running requests decode one token per step;
    when a request needs a block and none is free, the most recently admitted running
    request is preempted (its blocks freed, to be recomputed later from prompt + output
    so far). Requests that could never fit raise ``ValueError`` at ``add``; requests
    that merely do not fit now wait. With ``lora_slots``, a request naming an adapter
    also waits for a device slot holding it (``LoraSlots``), which it holds while it
    runs.
    """

    def __init__(
        self,
        pool: BlockPool,
        limits: EngineLimits,
        eos_token_ids: tuple[int, ...] = (),
        propose: Proposal | None = None,
        num_speculative: int = 0,
        decode: Decode | None = None,
        lora_slots: LoraSlots | None = None,
    ) -> None:
        self.pool = pool
        self.lora_slots = lora_slots
        self.limits = limits
        self.block_size = limits.block_size
        self.max_num_seqs = limits.max_num_seqs
        self.max_num_batched_tokens = limits.max_num_batched_tokens
        self.max_model_len = limits.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode = decode  # token ids to text, for stop strings (None: no tokenizer)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # over the scheduler's life
        self.propose = propose
        self.num_speculative = num_speculative if propose is not None else 0
        self._ids = itertools.count()

    def add(
        self, prompt: list[int], params: SamplingParams, lora: LoraAdapter | None = None
    ) -> Request:
        """Queues a request, one per sample where ``params.n`` > 1 (each with
        ``params.sample(i)``; the first is returned and leads the others, which queue
        behind it and read its full prompt blocks once it has computed them), with
        ``lora``'s adapter where given; raises ``ValueError`` (see ``check``) if it could
        never run."""
        self.check(prompt)
        if params.stop and self.decode is None:
            raise ValueError("stop: stop strings need the model's tokenizer; this model has none")
        if lora is not None and self.lora_slots is None:
            raise ValueError(f"lora: {lora.name!r} asked of an engine built without LoRA")
        samples = []
        for i in range(params.n):
            p = params.sample(i)
            stop = StopText(p.stop, self.decode) if p.stop else None
            samples.append(Request(next(self._ids), list(prompt), p, stop_text=stop, lora=lora))
        leader = samples[0]
        leader.others = samples[1:]
        for other in leader.others:
            other.leader = leader
        self.waiting.extend(samples)
        return leader

    def check(self, prompt: list[int]) -> None:
        """Raises ``ValueError`` naming the limit if ``prompt`` could never be scheduled."""
        if not prompt:
            raise ValueError("prompt: empty; give at least one token")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}; shorten it or raise max_model_len"
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

    def schedule(self) -> ScheduledBatch:
        """The next step: every running request that fits (decodes, then unfinished
        prefill chunks), then new admissions while tokens, sequences and blocks allow."""
        scheduled: list[ScheduledRequest] = []
        drafting: list[tuple[ScheduledRequest, int]] = []
        budget = self.max_num_batched_tokens
        preemptions = self.num_preemptions  # (a membership test per request only after one)
        for req in list(self.running):
            if budget == 0:
                break
            if self._awaits_last_token(req) or (
                self.num_preemptions != preemptions and req not in self.running
            ):
                continue  # done once its token resolves, or preempted to make room
            total = req.num_tokens
            chunk = min(total - req.num_cached, budget)
            room = self._draft_room(req, budget) if chunk == 1 and self.num_speculative else 0
            if not self._reserve(req, req.num_cached + chunk + room):
                continue
            scheduled.append(self._chunk(req, chunk, total))
            if room:
                drafting.append((scheduled[-1], room))
            budget -= chunk + room
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            if req.num_pending:
                break  # preempted with a token on the device: recompute it once known
            shared = self._shared(req)
            if shared is None:
                break  # its leader computes the prompt blocks it will read
            need = blocks_needed(req.num_tokens, self.block_size) - len(shared)
            if need > self.pool.num_free or not self._take_lora_slot(req):
                break
            self.waiting.popleft()
            req.blocks = self.pool.share(shared) + self.pool.allocate(need)
            req.num_cached = len(shared) * self.block_size
            self.running.append(req)
            total = req.num_tokens
            chunk = min(total - req.num_cached, budget)
            scheduled.append(self._chunk(req, chunk, total))
            budget -= chunk
        if drafting:
            self._add_drafts(drafting)
        loads = self.lora_slots.take_loads() if self.lora_slots is not None else []
        return ScheduledBatch(scheduled, loads)

    def _take_lora_slot(self, req: Request) -> bool:
        """Gives ``req`` a slot holding its adapter (True with none asked); False when
        every slot is in use: it waits (first come, first served)."""
        if req.lora is None:
            return True
        assert self.lora_slots is not None  # (``add`` refuses an adapter without slots)
        slot = self.lora_slots.acquire(req.lora)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _shared(self, req: Request) -> list[int] | None:
        """The blocks ``req`` reads from its leader instead of computing them: the
        leader's full blocks of the prompt (all but its last token, whose logits ``req``
        needs), which the leader never writes again. [] where it computes its own (no
        leader, preempted once, speculative decoding, a prompt within one block, or the
        leader ended); None while the leader has yet to compute them."""
        leader, full = req.leader, (len(req.prompt) - 1) // self.block_size
        if leader is None or req.num_preemptions or self.num_speculative or not full:
            return []
        if leader.finished:
            return []  # (its blocks are freed)
        computed = leader.num_cached >= full * self.block_size and len(leader.blocks) >= full
        return leader.blocks[:full] if computed and leader in self.running else None

    def _awaits_last_token(self, req: Request) -> bool:
        """True when ``req``'s pending token is its last one by count (``max_tokens`` or
        ``max_model_len``): nothing more to schedule until it is resolved."""
        if not req.num_pending:
            return False
        generated = len(req.output) + req.num_pending
        return generated >= req.params.max_tokens or req.num_tokens >= self.max_model_len

    def _draft_room(self, req: Request, budget: int) -> int:
        """How many tokens to propose after ``req``'s last one: at most
        ``num_speculative``, none past its ``max_tokens`` or ``max_model_len``, and within
        the step's token budget (0: decode without a draft)."""
        if not self.num_speculative or req.num_pending or not req.output:
            return 0
        return max(
            0,
            min(
                self.num_speculative,
                req.params.max_tokens - len(req.output) - 1,
                self.max_model_len - req.num_tokens - 1,
                budget - 1,
            ),
        )

    def _add_drafts(self, drafting: list[tuple[ScheduledRequest, int]]) -> None:
        """Asks the proposer for every drafting request at once; a short proposal is
        padded with its last token (or the request's) so verify batches stay uniform."""
        assert self.propose is not None
        proposals = self.propose([e.request for e, _ in drafting], [n for _, n in drafting])
        for (entry, room), proposal in zip(drafting, proposals, strict=True):
            draft = list(proposal)[:room]
            fill = draft[-1] if draft else entry.tokens[-1]
            entry.draft = draft + [fill] * (room - len(draft))
            entry.tokens = entry.tokens + entry.draft

    @staticmethod
    def _chunk(req: Request, n: int, total: int) -> ScheduledRequest:
        """The next ``n`` of ``req``'s ``total`` tokens (``num_tokens``, which the caller
        has: the scheduling loop runs once per request per step)."""
        start = req.num_cached
        if n == 1 and start == total - 1 and req.num_pending:
            return ScheduledRequest(req, [PENDING_TOKEN], start, from_previous=True)
        if n == 1 and start == total - 1 and req.output:
            tokens = [req.output[-1]]  # a decode: no need to rebuild prompt + output
        else:
            tokens = req.tokens[start : start + n]
        return ScheduledRequest(req, tokens, start, samples=start + n == total)

    def _reserve(self, req: Request, num_tokens: int, preempt: bool = True) -> bool:
        """Makes ``req`` hold blocks for ``num_tokens``, preempting others if needed
        (with ``preempt=False``, from free blocks only).

        Returns False if ``req`` itself had to be preempted, or the free blocks do not
        suffice and preemption is off.
        """
        if num_tokens <= len(req.blocks) * self.block_size:
            return True  # (a decode within its last block: most steps of most requests)
        need = blocks_needed(num_tokens, self.block_size) - len(req.blocks)
        if not preempt and need > self.pool.num_free:
            return False
        while need > self.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.blocks += self.pool.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_cached = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, step: ScheduledBatch, sampled: Sequence[int | Sequence[int]]) -> list[Request]:
        """Records the sampled token of each scheduled request that samples (one entry
        per scheduled request; others' entries are ignored); returns those that finished.
        The synchronous engine's ``launched`` then ``resolve``."""
        self.launched(step)
        return self.resolve(step, sampled)

    def launched(self, step: ScheduledBatch) -> None:
        """``step`` is on the device: its tokens count as cached, and each request that
        samples holds a pending token until ``resolve``."""
        for s in step.scheduled:
            s.request.num_cached = s.start + len(s.tokens)
            if s.samples:
                s.request.num_pending += 1

    def resolve(
        self,
        step: ScheduledBatch,
        sampled: Sequence[int | Sequence[int]],
        logprobs: Sequence[TokenLogprob | None] = (),
    ) -> list[Request]:
        """Replaces ``step``'s pending tokens by ``sampled`` (one entry per scheduled
        request: a token, or for a request that verified a draft the tokens it accepted
        plus the one after) and applies the stop conditions to each token in turn;
        returns the requests that finished. ``logprobs``: per scheduled request, its
        token's ``TokenLogprob`` where it asked for them (a step without any: empty),
        kept with the token.
        A token sampled for a request that finished meanwhile (an asynchronous step
        launched before its stop token was known) is dropped."""
        done = []
        for i, (s, got) in enumerate(zip(step.scheduled, sampled, strict=True)):
            req = s.request
            if not s.samples:
                continue
            req.num_pending -= 1
            if req.finished:
                continue
            tokens = [got] if isinstance(got, int) else list(got)
            if s.draft:
                # Accepted drafts and one more: K/V is valid for the inputs up to the last
                # accepted draft; the rejected drafts' slots are written again later.
                req.num_cached = s.start + len(tokens)
            logprob = logprobs[i] if logprobs else None
            if logprob is not None:
                req.logprobs.append(logprob)  # (one token: verify steps have none)
            for token in tokens:
                req.output.append(token)
                if self._finish(req, token):
                    self._release(req)
                    done.append(req)
                    break
        return done

    def _finish(self, req: Request, token: int) -> bool:
        p = req.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            req.finish_reason = FinishReason.STOP
        elif req.stop_text is not None and req.stop_text.hit(req.output):
            req.finish_reason = FinishReason.STOP
        elif len(req.output) >= p.max_tokens:
            req.finish_reason = FinishReason.LENGTH
        elif len(req.prompt) + len(req.output) >= self.max_model_len:
            # Resolved tokens only: a later step's token may already be pending.
            req.finish_reason = FinishReason.MAX_MODEL_LEN
        return req.finished

    def abort(self, requests: list[Request]) -> None:
        """Ends ``requests`` and the samples they lead (finish reason ABORT) wherever they
        are and frees their KV blocks; finished ones are left alone. A token a step still
        on the device samples for one of them is dropped when that step resolves."""
        requests = [r for req in requests for r in req.group]  # (a leader ends its samples)
        ids = {r.id for r in requests if not r.finished}
        if not ids:
            return
        for r in requests:
            if r.id in ids:
                r.finish_reason = FinishReason.ABORT
        self.waiting = deque(r for r in self.waiting if r.id not in ids)
        for req in [r for r in self.running if r.id in ids]:
            self._release(req)

    def reset(self) -> None:
        """Drops every request and frees every block: the state after a call that failed
        or was interrupted (calls run one at a time, so everything queued was that
        call's). Derived, not repaired: whatever line an interrupt stopped (a block taken
        from the pool but not yet given to its request, a finished request not yet out
        of ``running``), nothing is owned afterwards. Safe to call again."""
        for req in [*self.running, *self.waiting]:
            req.blocks = []
            req.lora_slot = -1
        self.running = []
        self.waiting = deque()
        self.pool.reset()
        if self.lora_slots is not None:
            self.lora_slots.reset()

    def _release(self, req: Request) -> None:
        # Blocks freed here may still be written by a step already on the device; a
        # later step that reuses them runs after it on the same stream.
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)  # preempted while its last token was on the device
        self.pool.free(req.blocks)
        req.blocks = []
        if req.lora_slot >= 0:
            assert self.lora_slots is not None
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = -1
