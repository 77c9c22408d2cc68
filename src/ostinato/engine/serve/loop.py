"""``EngineLoop``: one thread owns an ``LLM`` and steps it; any thread or asyncio task
submits requests, streams their tokens and aborts them.

Guarantees: requests are checked in the caller's thread (``submit`` raises the same
``ValueError`` / ``TypeError`` as ``generate``, naming the field) and run in the loop's
thread only, so the scheduler and the step buffers have one owner; a request's tokens are
those ``generate`` gives it alone (greedy), whoever else is running; ``abort(id)`` takes
effect at the next step boundary and frees the request's KV blocks; a step that raises
ends every running request with that error and leaves the engine clean (the scheduler
is reset), and the loop goes on serving; on an engine with tensor-parallel worker
processes such a step stops the engine, and later requests end with the error naming the
failed rank. While the loop runs it holds the engine (``LLM.serving``): ``LLM.generate``
from other threads waits until ``stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ostinato import switch_interval
from ostinato.engine.api.engine import Session, Tracked
from ostinato.engine.api.llm import LLM
from ostinato.engine.api.prompts import Prompt, chat_ids, decode_text
from ostinato.engine.core.logprob import TokenLogprob
from ostinato.engine.core.params import SamplingParams
from ostinato.engine.core.scheduler import FinishReason
from ostinato.replay_stats import StatsSnapshot

_END = object()
SWITCH_INTERVAL_S = 0.0005  # while the loop runs (see _run)


@dataclass
class LoopStats:
    """Counters of a loop's life; ``status()`` reads the steps and their times."""

    requests: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    tokens: int = 0
    steps: int = 0
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=1024))  # last
    busy_seconds: float = 0.0  # in steps, since the start
    publish_seconds: float = 0.0  # handing the steps' tokens on (``publish``)

    def record_step(self, seconds: float) -> None:
        """Counts one step of ``seconds``."""
        self.steps += 1
        self.step_seconds.append(seconds)
        self.busy_seconds += seconds


@dataclass(frozen=True, slots=True)
class EngineTiming:
    """Where one request waited in the engine before its first token (seconds, measured
    in the engine's process): ``queued`` from the engine's accepting it to the step
    boundary that admitted it to the scheduler; ``prefill`` from that admission to the
    end of the step that handed out its first token (a wait for a seat or KV blocks
    included)."""

    queued: float
    prefill: float


@dataclass(slots=True)  # not frozen: a step makes one per running request, and a frozen
class TokenEvent:  # dataclass's __init__ took four times as long (64: 48.6 / 12.1 µs, CPU)
    """What one step did to one request: its new tokens (with their log probabilities
    where it asked) and, if it ended, why (or the error that ended it). A step's events
    travel together (``EngineLoop``'s ``publish``); nothing changes one once published."""

    request_id: str
    tokens: list[int]
    ended: bool = False
    finish: FinishReason | None = None
    error: BaseException | None = None
    logprobs: list[TokenLogprob] | None = None
    timing: EngineTiming | None = None  # on the event with the request's first tokens


@dataclass(frozen=True)
class EngineStatus:
    """The engine as ``/health`` and ``/metrics`` see it, read at one moment."""

    queue_depth: int
    running: int
    steps: int
    step_seconds_mean: float
    busy_seconds: float  # in steps since the start: over a wall interval, how busy
    publish_seconds: float  # handing tokens to the streams (a slow reader shows here)
    tokens: int  # generated since the start
    kv_blocks: int
    free_kv_blocks: int
    capturing: bool
    graph_stats: StatsSnapshot


class RequestHandle:
    """One request: its ``id``, a blocking iterator (``for token in handle``) and an async
    one (``async for token in handle``) over its token ids, and, once they end,
    ``finish_reason``. An iterator raises the engine's error if the request failed.
    ``logprobs``: where the request asked, one per token, each there before the
    iterators hand out its token. With ``SamplingParams.n`` > 1 the handle is the first
    sample's, and ``others`` are the rest, each a handle of its own (aborting this
    handle's id ends them all). ``timing``: where the engine kept it before its first
    tokens, there before the iterators hand them out (None until then, and for a
    request whose first event had none)."""

    def __init__(self, request_id: str, prompt: list[int], aloop: Any = None) -> None:
        self.id = request_id
        self.prompt = prompt
        self.finish_reason: FinishReason | None = None
        self.logprobs: list[TokenLogprob] = []
        self.timing: EngineTiming | None = None
        self.others: list[RequestHandle] = []  # samples 2 to n (``SamplingParams.n``)
        self._aloop = aloop
        self._queue: queue.Queue[Any] = queue.Queue()
        self._inbox = _Inbox(aloop) if aloop is not None else None

    def _put(self, item: Any, post: _Post | None = None) -> None:
        if self._inbox is None:
            self._queue.put(item)
        elif post is not None:
            post.add(self._aloop, self._inbox, item)
        else:
            self._aloop.call_soon_threadsafe(self._inbox.arrive, item)

    def _end(
        self,
        reason: FinishReason | None,
        error: BaseException | None = None,
        post: _Post | None = None,
    ) -> None:
        self.finish_reason = reason
        self._put(error if error is not None else _END, post)

    def __iter__(self) -> Iterator[int]:
        if self._inbox is not None:
            raise TypeError("this request was submitted with asubmit: use `async for`")
        while (item := self._queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield from item

    @property
    def samples(self) -> list[RequestHandle]:
        """The handles of every sample: this one (the first sample), then ``others``."""
        return [self, *self.others]

    def accepted(self, prompt: list[int]) -> None:
        """Records the prompt's token ids, once the engine took it, on every sample."""
        for h in self.samples:
            h.prompt = prompt

    async def __aiter__(self) -> AsyncIterator[int]:
        async for chunk in self.chunks():
            for token in chunk:
                yield token

    async def chunks(self) -> AsyncIterator[list[int]]:
        """The tokens as they arrive, grouped: each list holds every token that arrived
        since the reader last took some (one step's, or more when it fell behind), so a
        slow reader catches up in fewer, larger pieces."""
        if self._inbox is None:
            raise TypeError("this request was submitted with submit: use `for`")
        ended = False
        while not ended:
            chunk: list[int] = []
            for item in await self._inbox.take():
                if item is _END:
                    ended = True
                    break
                if isinstance(item, BaseException):
                    raise item
                chunk.extend(item)
            if chunk:
                yield chunk


class _Inbox:
    """What arrived for one asyncio reader since it last took: the event loop's thread
    adds (``arrive``), the reader takes it all at once (``take``), waiting on one future
    when nothing is there. Why not an ``asyncio.Queue``: the server's event loop hands
    on every token of every stream, and a queue made a future for each get and raised
    its empty-queue exception to end each batch (with ``_Meta``'s event head written
    once, a streamed event's own cost fell by about a third on the development machine:
    12-26 against 10-18 us over alternating runs, the HTTP framework's not counted)."""

    def __init__(self, aloop: Any) -> None:
        self._aloop = aloop
        self._items: list[Any] = []
        self._waiter: asyncio.Future[None] | None = None

    def arrive(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Any]:
        """Everything that arrived since the last take (at least one item)."""
        while not self._items:
            self._waiter = self._aloop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class _Post:
    """Items for asyncio readers, handed to each event loop in one call per step (each
    ``call_soon_threadsafe`` wakes the loop through a pipe)."""

    def __init__(self) -> None:
        self._by_loop: dict[Any, list[tuple[_Inbox, Any]]] = {}

    def add(self, aloop: Any, inbox: _Inbox, item: Any) -> None:
        self._by_loop.setdefault(aloop, []).append((inbox, item))

    def send(self) -> None:
        for aloop, items in self._by_loop.items():
            aloop.call_soon_threadsafe(_deliver, items)
        self._by_loop.clear()


def _deliver(items: list[tuple[_Inbox, Any]]) -> None:
    for inbox, item in items:
        inbox.arrive(item)


Enqueue = Callable[[str, Prompt, Any, Any], list[int]]  # (id, prompt, params, LoRA name)


class Handles:
    """The handles of live requests by id; ``deliver`` hands a step's events to them (one
    wake-up per event loop). Used by the loop itself and by ``EngineProcess``'s reader."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, RequestHandle] = {}

    def open(
        self,
        request_id: str,
        aloop: Any,
        enqueue: Enqueue,
        prompt: Prompt,
        params: Any,
        lora: str | None = None,
    ) -> RequestHandle:
        """A handle for a new request, registered before ``enqueue`` queues the request
        (its first events may come at once) and dropped again if ``enqueue`` refuses it."""
        handle = self.register(request_id, aloop, params)
        try:
            handle.accepted(enqueue(request_id, prompt, params, lora))
        except BaseException:
            self.discard(request_id)
            raise
        return handle

    def register(self, request_id: str, aloop: Any, params: Any) -> RequestHandle:
        """A handle for ``request_id`` and, where ``params`` asks for ``n`` > 1 samples,
        one per other sample (``sample_id``), all registered."""
        n = params.n if isinstance(params, SamplingParams) else 1
        handle = RequestHandle(request_id, [], aloop)
        handle.others = [RequestHandle(sample_id(request_id, i), [], aloop) for i in range(1, n)]
        with self._lock:
            self._by_id.update({h.id: h for h in handle.samples})
        return handle

    def discard(self, request_id: str) -> None:
        """Drops the handle of ``request_id`` and of its other samples."""
        with self._lock:
            handle = self._by_id.pop(request_id, None)
            for other in handle.others if handle is not None else ():
                self._by_id.pop(other.id, None)

    def ids(self) -> list[str]:
        """The ids of the requests open now."""
        with self._lock:
            return list(self._by_id)

    def deliver(self, events: list[TokenEvent]) -> None:
        """Hands each event's log probabilities, timing and tokens to its request's handle
        (an event of a request no longer open is dropped) and ends the handles of the
        events that end; the waiting readers are woken after the lock is let go."""
        post = _Post()
        with self._lock:
            for e in events:
                handle = self._by_id.get(e.request_id)
                if handle is None:
                    continue
                if e.logprobs:
                    handle.logprobs.extend(e.logprobs)  # (before the tokens are handed out)
                if e.timing is not None:
                    handle.timing = e.timing
                if e.tokens:
                    handle._put(e.tokens, post)
                if e.ended:
                    del self._by_id[e.request_id]
                    handle._end(e.finish, e.error, post)
        post.send()

    def end_all(self, error: BaseException | None) -> None:
        """Ends every handle (ABORT, or ``error``): its engine is gone."""
        with self._lock:
            handles, self._by_id = list(self._by_id.values()), {}
        for handle in handles:
            handle._end(None if error else FinishReason.ABORT, error)


def sample_id(request_id: str, index: int) -> str:
    """The id the events of sample ``index`` of request ``request_id`` go under (the
    first sample's are the request's own)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def _ids(request_id: str, params: SamplingParams) -> list[str]:
    """The ids of every sample of a request (``sample_id``)."""
    return [sample_id(request_id, i) for i in range(params.n)]


Publish = Callable[[list[TokenEvent]], None]


class EngineLoop:
    """Serves ``llm`` from a thread of its own (see the module docstring).

    ``publish``: where each step's ``TokenEvent`` list goes; by default to the handles
    ``submit`` returned (``EngineProcess``'s engine side sends them to its parent)."""

    def __init__(self, llm: LLM, publish: Publish | None = None) -> None:
        self.llm = llm
        self._engine = llm.engine
        self.max_model_len: int = llm.engine.scheduler.max_model_len  # prompt + output
        self.stats = LoopStats()
        self._ids = itertools.count()
        self._handles = Handles()
        self._sink = publish or self._handles.deliver
        self._submitted: queue.Queue[tuple[str, list[int], SamplingParams, Any, float]] = (
            queue.Queue()
        )
        self._live: dict[str, Tracked] = {}
        # Per live request (and sample) until its first tokens: when the engine accepted
        # it and when a step boundary admitted it (``EngineTiming``).
        self._since: dict[str, tuple[float, float]] = {}
        self._owners: dict[str, str] = {}  # a later sample's id -> its request's id
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ostinato-engine", daemon=True)
        self._refused: BaseException | None = None
        self._thread.start()
        self._started.wait()
        if self._refused is not None:
            raise self._refused

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None for random weights)."""
        return self.llm.tokenizer

    def decode(self, token_ids: Sequence[int]) -> str:
        return decode_text(self.llm.tokenizer, token_ids)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_ids(self.llm.tokenizer, messages)

    @property
    def lora_names(self) -> list[str]:
        """The engine's LoRA adapters' names (requests name one as their ``lora``)."""
        return self.llm.lora_names

    async def aload_lora(self, name: str, path: str) -> None:
        """``LLM.load_lora`` off the event loop (it reads the adapter's files); its
        errors as it raises them. Requests may name ``name`` once this returns."""
        await asyncio.to_thread(self.llm.load_lora, name, path)

    async def aunload_lora(self, name: str) -> None:
        """``LLM.unload_lora`` (``UnknownAdapter``, ``AdapterInUse`` as it raises them)."""
        await asyncio.to_thread(self.llm.unload_lora, name)

    def submit(
        self, prompt: Prompt, params: SamplingParams | None = None, lora: str | None = None
    ) -> RequestHandle:
        """Queues ``prompt`` (token ids, or text with a tokenizer); returns its handle.
        Checks everything first: ``ValueError`` / ``TypeError`` name the problem."""
        rid = f"req-{next(self._ids)}"
        return self._handles.open(rid, None, self.enqueue, prompt, params, lora)

    async def asubmit(
        self, prompt: Prompt, params: SamplingParams | None = None, lora: str | None = None
    ) -> RequestHandle:
        """``submit`` for asyncio: the handle's tokens arrive on the running event loop."""
        aloop = asyncio.get_running_loop()
        rid = f"req-{next(self._ids)}"
        return self._handles.open(rid, aloop, self.enqueue, prompt, params, lora)

    def enqueue(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None,
        lora: str | None = None,
    ) -> list[int]:
        """Checks and queues one request under ``request_id`` (its events are published
        under that id, those of its sample ``i`` > 0 under ``sample_id``); returns its
        prompt's token ids."""
        if self._stop.is_set():
            raise RuntimeError("submit: the engine loop is stopped")
        ((tokens, p, adapter),) = self._engine.checked([prompt], params, lora)
        self._engine.reserve([request_id], request_id)
        self._submitted.put((request_id, tokens, p, adapter, time.perf_counter()))
        self._wake.set()
        return tokens

    def abort(self, request_id: str) -> bool:
        """Ends request ``request_id`` at the next step boundary (finish reason ABORT) and
        frees its KV blocks; False for an unknown or finished id (``LLM.abort``)."""
        asked = self.llm.abort(request_id)
        self._wake.set()
        return asked

    @property
    def queue_depth(self) -> int:
        """Requests submitted and not yet admitted, plus those waiting for a seat."""
        return self._submitted.qsize() + self._engine.waiting

    @property
    def running(self) -> int:
        """Requests admitted and not finished."""
        return len(self._live)

    def status(self) -> EngineStatus:
        """The engine now (safe from any thread)."""
        llm, seconds = self.llm, list(self.stats.step_seconds)
        background = llm.background
        return EngineStatus(
            queue_depth=self.queue_depth,
            running=self.running,
            steps=self.stats.steps,
            step_seconds_mean=sum(seconds) / max(1, len(seconds)),
            busy_seconds=self.stats.busy_seconds,
            publish_seconds=self.stats.publish_seconds,
            tokens=self.stats.tokens,
            kv_blocks=llm.num_kv_blocks,
            free_kv_blocks=llm.free_kv_blocks,
            capturing=background is not None and not background.done,
            graph_stats=llm.graph_stats(),
        )

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Ends every request (ABORT), frees its blocks and releases the engine."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _publish(self, events: list[TokenEvent]) -> None:
        if events:
            start = time.perf_counter()
            self._sink(events)
            self.stats.publish_seconds += time.perf_counter() - start

    def _run(self) -> None:
        # The server's event loop shares the interpreter: when this thread's wait on the
        # device ends, it would wait for the loop's next switch, up to 5 ms by default.
        with switch_interval.lowered(SWITCH_INTERVAL_S):
            self._serve()

    def _serve(self) -> None:
        with contextlib.ExitStack() as stack:
            try:
                session = stack.enter_context(self.llm.serving())
            except BaseException as exc:  # refused (a closed or failed engine): __init__ raises it
                self._refused = exc
                return
            finally:
                self._started.set()
            self._serve_in(session)

    def _serve_in(self, session: Session) -> None:
        steps: Iterator[None] | None = None
        while not self._stop.is_set():
            events = self._admit(session)
            session.apply_aborts()
            if steps is None:
                if not session.has_work:
                    self._publish(events + self._emit())  # aborted while nothing ran
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                steps = session.steps()
            if events:
                self._publish(events)
            steps = self._step(steps, session)
        self._end_all(FinishReason.ABORT, None, session)
        session.reset()  # (a step may still be in flight: its tokens go)

    def _admit(self, session: Session) -> list[TokenEvent]:
        ended = []
        while True:
            try:
                request_id, prompt, params, adapter, queued_at = self._submitted.get_nowait()
            except queue.Empty:
                return ended
            self.stats.requests += 1
            if session.aborted_early(request_id):  # aborted before it was queued
                ended += [
                    self._ended(rid, FinishReason.ABORT, []) for rid in _ids(request_id, params)
                ]
                continue
            tracked = session.admit(request_id, prompt, params, adapter)
            self._live[request_id] = tracked
            since = (queued_at, time.perf_counter())
            self._since[request_id] = since
            for i, other in enumerate(tracked.request.others, start=1):
                self._live[sample_id(request_id, i)] = Tracked(sample_id(request_id, i), other)
                self._owners[sample_id(request_id, i)] = request_id
                self._since[sample_id(request_id, i)] = since

    def _step(self, steps: Iterator[None], session: Session) -> Iterator[None] | None:
        """Runs one step; the iterator to go on with (None once it ended or failed)."""
        start = time.perf_counter()
        try:
            next(steps)
        except StopIteration:
            self._publish(self._emit())
            return None
        except Exception as exc:  # the step's error ends its requests; the loop serves on
            session.reset()
            self.stats.failed += len(self._live)
            self._end_all(None, exc, session)
            return None
        self.stats.record_step(time.perf_counter() - start)
        self._publish(self._emit())
        return steps

    def _emit(self) -> list[TokenEvent]:
        """Each request's new tokens; the finished (or aborted) ones end."""
        events, tokens, now = [], 0, time.perf_counter()
        for request_id, live in list(self._live.items()):
            start, request = live.emitted, live.request
            new = live.take()
            tokens += len(new)
            asked = request.params.logprobs is not None
            logprobs = request.logprobs[start : start + len(new)] if asked else None
            timing = self._first(request_id, now) if new and not start else None
            if request.finish_reason is not None:
                del self._live[request_id]
                # The request's id stays reserved (abortable) until its last sample ends.
                group = request.leader or request
                reason = request.finish_reason
                ended = self._ended(request_id, reason, new, logprobs, group.all_finished)
                ended.timing = timing
                events.append(ended)
            elif new:
                events.append(TokenEvent(request_id, new, False, None, None, logprobs, timing))
        self.stats.tokens += tokens
        return events

    def _first(self, request_id: str, now: float) -> EngineTiming | None:
        """The timing of ``request_id``'s first tokens, handed out at ``now``."""
        since = self._since.pop(request_id, None)
        if since is None:
            return None
        queued_at, admitted_at = since
        return EngineTiming(admitted_at - queued_at, now - admitted_at)

    def _ended(
        self,
        request_id: str,
        reason: FinishReason | None,
        new: list[int],
        logprobs: list[TokenLogprob] | None = None,
        release: bool = True,
    ) -> TokenEvent:
        """The last event of ``request_id`` (a request, or one of its samples); with
        ``release`` the id of the request it belongs to is released (``Engine.end``)."""
        owner = self._owners.pop(request_id, request_id)
        self._since.pop(request_id, None)
        if release:
            self._engine.end(owner)
        if reason is FinishReason.ABORT:
            self.stats.aborted += 1
        elif reason is not None:
            self.stats.finished += 1
        return TokenEvent(request_id, new, True, reason, logprobs=logprobs)

    def _end_all(
        self, reason: FinishReason | None, error: BaseException | None, session: Session
    ) -> None:
        if reason is FinishReason.ABORT and self._live:
            session.abort(list(self._live.values()))
        ids = list(self._live)
        self._live.clear()
        self._owners.clear()
        self._since.clear()
        while True:  # submitted but never admitted
            try:
                request_id, _, params, _, _ = self._submitted.get_nowait()
            except queue.Empty:
                break
            ids += _ids(request_id, params)
        for rid in ids:
            self._engine.end(rid)
        self._publish([TokenEvent(rid, [], True, reason, error) for rid in ids])
