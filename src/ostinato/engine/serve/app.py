"""The OpenAI-compatible HTTP server over an ``EngineLoop`` (FastAPI; run by uvicorn).

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (``stream`` for
server-sent events), ``GET /v1/models`` and ``/v1/models/{id}``, ``GET /health`` (ready
once the engine answers; says whether graphs are still being captured), ``GET /metrics``
(Prometheus text), and ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
(``lora_routes``).

Guarantees: nothing a client sends is silently ignored: a bad request, an unknown
field, or a field asking for an effect this server does not give (``bodies``) is a 400
with OpenAI's error body naming the field (``param``); another model is a 404
(``model_not_found``); a body over the bound is a 413 and, with a key, a request
without it a 401 (``http_guard``). A streaming client that disconnects, or a waiting
one that goes away, aborts its request (its KV blocks are freed at the next step).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ostinato.engine.api.lora_registry import UnknownAdapter
from ostinato.engine.api.text_stream import TextStream
from ostinato.engine.core.params import MAX_SAMPLES, SamplingParams
from ostinato.engine.core.stop_text import StopText
from ostinato.engine.serve.bodies import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatBody,
    CompletionBody,
    RequestBody,
    refusal,
)
from ostinato.engine.serve.errors import BadRequest, ModelNotFound, add_error_handlers
from ostinato.engine.serve.http_guard import DEFAULT_MAX_BODY_BYTES, HttpGuard
from ostinato.engine.serve.logprob_shapes import LogprobShapes
from ostinato.engine.serve.loop import EngineStatus, RequestHandle
from ostinato.engine.serve.lora_routes import add_lora_routes
from ostinato.replay_stats import StatsSnapshot


class Engine(Protocol):
    """What the server needs of an engine: ``EngineLoop`` (in this process) and
    ``EngineProcess`` (in a child process; what ``serve`` runs) both are one."""

    tokenizer: Any
    max_model_len: int  # prompt and output tokens of one request, at most
    lora_names: list[str]  # the LoRA adapters a request's ``model`` may name

    async def asubmit(
        self, prompt: Any, params: SamplingParams | None = None, lora: str | None = None
    ) -> RequestHandle: ...

    def abort(self, request_id: str) -> bool: ...

    async def aload_lora(self, name: str, path: str) -> None: ...

    async def aunload_lora(self, name: str) -> None: ...

    def status(self) -> EngineStatus: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]: ...


# Seconds: from a millisecond (a step of a small model) to over a minute (a long queue).
LATENCY_BUCKETS = tuple(0.001 * 2**i for i in range(17))


class Metrics:
    """The Prometheus series of one server: counters kept here, and the engine's state
    read once per scrape (``EngineCollector``). The time to first token is split where a
    request waits: ``accept`` (here: checks, tokenizing, the engine's answer), then in the
    engine ``queue`` and ``prefill`` (``EngineTiming``); what TTFT holds beyond
    the three is the hand-over of the first tokens from the engine to the response.
    This HTTP process's own series (CPU seconds, memory, the collector's runs) are
    prometheus_client's, as its default registry has them: a CPU second per second
    says its event loop is the bottleneck."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ostinato_requests", "Requests received", ["route"], registry=r)
        self.tokens = Counter("ostinato_generated_tokens", "Tokens streamed out", registry=r)
        self.aborted = Counter("ostinato_aborted_requests", "Requests aborted", registry=r)
        self.ttft = _histogram(
            r, "time_to_first_token", "From a request's arrival to its first tokens' event"
        )
        self.accept = _histogram(
            r, "request_accept", "From a request's arrival to the engine's accepting it"
        )
        self.queue = _histogram(
            r, "request_queue", "In the engine, from accepting a request to its admission"
        )
        self.prefill = _histogram(
            r,
            "request_prefill",
            "In the engine, from a request's admission to its first tokens (a wait for a "
            "seat or KV blocks included)",
        )
        r.register(EngineCollector(engine))
        ProcessCollector(registry=r)
        GCCollector(registry=r)

    def first_tokens(self, handle: RequestHandle, arrived: float) -> None:
        """Records the time to ``handle``'s first tokens, which are here now, and where
        the engine kept it (``handle.timing``: absent where its first event had none)."""
        self.ttft.observe(time.perf_counter() - arrived)
        if handle.timing is not None:
            self.queue.observe(handle.timing.queued)
            self.prefill.observe(handle.timing.prefill)


def _histogram(registry: CollectorRegistry, name: str, about: str) -> Histogram:
    return Histogram(f"ostinato_{name}_seconds", about, buckets=LATENCY_BUCKETS, registry=registry)


class EngineCollector:
    """Series read from one ``EngineStatus`` at each scrape: queue and running requests,
    steps, their mean time and total, the time spent handing tokens on, tokens, steps
    from graphs per bucket, eager steps by reason, and real versus padded rows."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        status = self.engine.status()
        yield GaugeMetricFamily("ostinato_queue_depth", "Requests waiting", status.queue_depth)
        yield GaugeMetricFamily("ostinato_running_requests", "Requests running", status.running)
        yield CounterMetricFamily("ostinato_engine_steps", "Engine steps run", status.steps)
        yield GaugeMetricFamily(
            "ostinato_step_seconds_mean", "Mean of the last steps", status.step_seconds_mean
        )
        yield CounterMetricFamily(
            "ostinato_engine_busy_seconds", "Seconds the engine spent in steps", status.busy_seconds
        )
        yield CounterMetricFamily(
            "ostinato_engine_publish_seconds",
            "Seconds the engine's loop spent handing tokens to the streams",
            status.publish_seconds,
        )
        yield CounterMetricFamily(
            "ostinato_engine_tokens", "Tokens the engine generated", status.tokens
        )
        yield from _graph_series(status.graph_stats)


def _graph_series(stats: StatsSnapshot) -> Iterator[Metric]:
    replays = CounterMetricFamily(
        "ostinato_graph_replays",
        "Steps run from graphs, per bucket (mode, padded size, uniform decode)",
        labels=["mode", "size", "uniform_decode"],
    )
    for b in stats.buckets:
        d = b.descriptor
        replays.add_metric(
            [b.mode.name, str(d.num_tokens), str(d.uniform_decode).lower()], b.replays
        )
    yield replays
    eager = CounterMetricFamily(
        "ostinato_eager_steps", "Steps run without graphs, by reason", labels=["reason"]
    )
    for reason, n in stats.eager_steps.items():
        eager.add_metric([reason.name.lower()], n)
    yield eager
    yield CounterMetricFamily(
        "ostinato_graph_real_rows", "Rows asked for in steps run from graphs", stats.real_rows
    )
    yield CounterMetricFamily(
        "ostinato_graph_padded_rows",
        "Rows computed by steps run from graphs (padding included)",
        stats.padded_rows,
    )
    yield GaugeMetricFamily(
        "ostinato_graph_padding_fraction",
        "Share of rows computed by graphs that were padding",
        stats.padding_fraction,
    )
    yield CounterMetricFamily(
        "ostinato_graph_checked_replays",
        "Replays compared with an eager run of the same step while serving",
        stats.checked_replays,
    )
    yield GaugeMetricFamily(
        "ostinato_graph_demoted_buckets",
        "Graphs taken out of service after differing from eager (their steps run eagerly)",
        len(stats.demoted),
    )


def build_app(
    engine: Engine,
    model_name: str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_key: str | None = None,
    runtime_lora: bool = False,
) -> FastAPI:
    """The server's app over ``engine``, answering as model ``model_name``; bodies over
    ``max_body_bytes`` are refused before they are parsed, and with ``api_key`` every
    route but ``/health`` needs it (``http_guard``). With ``runtime_lora`` clients may
    load and unload LoRA adapters (``lora_routes``)."""
    app = FastAPI(title="ostinato")
    app.add_middleware(HttpGuard, max_body_bytes=max_body_bytes, api_key=api_key)
    answer = Responder(engine, model_name)
    add_error_handlers(app)
    add_lora_routes(app, engine, model_name, runtime_lora)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        status = engine.status()
        graphs = "capturing" if status.capturing else "ready"
        blocks = {"kv_blocks": status.kv_blocks, "free_kv_blocks": status.free_kv_blocks}
        return {"status": "ok", "graphs": graphs, **blocks}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(answer.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards(model_name, engine.lora_names)}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        for card in model_cards(model_name, engine.lora_names):
            if card["id"] == model:
                return card
        raise ModelNotFound(f"The model `{model}` does not exist.")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        answer.metrics.requests.labels("completions").inc()
        return await answer(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request) -> Response:
        answer.metrics.requests.labels("chat").inc()
        if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
            raise BadRequest("messages: the model has no chat template", "messages")
        return await answer(body, request, chat=True)

    return app


def model_cards(model_name: str, adapters: list[str]) -> list[dict[str, Any]]:
    """``/v1/models``' entries: the served model, then each LoRA adapter as a model of its
    own whose parent is the served one (as vLLM lists them)."""
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "ostinato"}
    return [card, *({**card, "id": n, "parent": model_name} for n in adapters)]


class Responder:
    """Turns one request body into an engine request and its HTTP answer: whole, or
    streamed as server-sent events; aborts the request when its client goes away."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name
        self.metrics = Metrics(engine)

    async def __call__(self, body: RequestBody, request: Request, chat: bool) -> Response:
        arrived: float = request.state.arrived  # (``HttpGuard``: before the body was read)
        requests = await self._submit(body, chat)
        self.metrics.accept.observe(time.perf_counter() - arrived)
        kind = "chatcmpl" if chat else "cmpl"
        meta = _Meta(f"{kind}-{uuid.uuid4().hex[:12]}", self.model_name, chat)
        prompts = body.prompts() if isinstance(body, CompletionBody) else [None]
        # Choices prompt by prompt, each prompt's n samples in turn (OpenAI's order).
        samples = [
            s
            for p, r in zip(prompts, requests, strict=True)
            for s in self._samples(body, p, r, arrived)
        ]
        prompt_tokens = sum(len(r.prompt) for r in requests)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            extras = _Extras(usage, lambda: self._stop_text(body), prompt_tokens)
            events = self._stream(requests, samples, meta, extras)
            return StreamingResponse(events, media_type="text/event-stream")
        watcher = asyncio.create_task(self._abort_on_disconnect(request, requests))
        try:
            answers = await asyncio.gather(
                *(self._answer(s, self._stop_text(body)) for s in samples)
            )
        except BaseException:  # (one request failed: the others' answers are not sent)
            self._abort(requests)
            raise
        finally:
            watcher.cancel()
        return JSONResponse(meta.whole(answers, prompt_tokens))

    def _samples(
        self,
        body: RequestBody,
        prompt: str | list[int] | None,
        request: RequestHandle,
        arrived: float,
    ) -> list[_Sample]:
        """The choices of one engine request: each sample with the prompt's text where
        it is echoed, and log probabilities' shapes of its own where asked (their text
        offsets run on within a choice, never from one choice into the next)."""
        echo = self._echo(body, prompt, request)
        asked = body.asked_logprobs() is not None
        chat = isinstance(body, ChatBody)
        return [
            _Sample(
                h,
                echo,
                LogprobShapes(chat, self._token_text, len(echo)) if asked else None,
                arrived,
            )
            for h in request.samples
        ]

    async def _answer(self, sample: _Sample, stop: StopText | None) -> _Choice:
        """One sample's whole answer: its text (never the stop string), tokens, finish
        reason and log probabilities where asked."""
        handle = sample.handle
        tokens = [t async for chunk in self._timed(sample) for t in chunk]
        text = self.engine.decode(tokens) if self.engine.tokenizer is not None else ""
        text = stop.cut(text) if stop is not None else text
        shapes = sample.shapes
        logprobs = shapes.piece(handle.logprobs[: len(tokens)]) if shapes is not None else None
        return _Choice(sample.echo + text, tokens, _finish(handle), logprobs)

    def _token_text(self, token_id: int) -> str:
        """A token's text in log probabilities (its id where the model has no tokenizer,
        as vLLM writes it)."""
        if self.engine.tokenizer is None:
            return f"token_id:{token_id}"
        return self.engine.decode([token_id])

    def _echo(
        self, body: RequestBody, prompt: str | list[int] | None, request: RequestHandle
    ) -> str:
        """The prompt's text where a completion asks for it first (``echo``), else ""."""
        if not isinstance(body, CompletionBody) or not body.echo:
            return ""
        if isinstance(prompt, str):
            return prompt
        return self.engine.decode(request.prompt) if self.engine.tokenizer is not None else ""

    def _stop_text(self, body: RequestBody) -> StopText | None:
        stops = body.stop_strings()
        return StopText(stops, self.engine.decode) if stops else None

    async def _submit(self, body: RequestBody, chat: bool) -> list[RequestHandle]:
        """Checks ``body`` (the model, what is refused, each prompt's room in the context)
        and queues its prompts, one engine request each, all or none; ``BadRequest`` /
        ``ModelNotFound`` name what is wrong."""
        lora = self._lora(body)
        refused = refusal(body) or body.contradiction()
        if refused is not None:
            raise BadRequest(refused[1], refused[0])
        prompts = body.prompts() if isinstance(body, CompletionBody) else [None]
        if len(prompts) * body.n > MAX_SAMPLES:
            raise BadRequest(
                f"prompt: {len(prompts)} prompts of n {body.n} make {len(prompts) * body.n} "
                f"choices; at most {MAX_SAMPLES} a request",
                "prompt",
            )
        labels = _labels(chat, len(prompts))
        if all(isinstance(p, list) for p in prompts):
            # Token ids need no tokenizer, and each hop to a thread and back waits a turn
            # of a busy loop (2-5 ms at 64 streams on an H200).
            ids = prompts
        else:  # tokenizing long prompts takes a while: off the event loop, so streams go on
            ids = await asyncio.to_thread(self._prompt_ids, body, prompts, labels)
        params = [self._params(body, len(i), label) for i, label in zip(ids, labels, strict=True)]
        queued: list[RequestHandle] = []
        try:
            for prompt_ids, p, label in zip(ids, params, labels, strict=True):
                queued.append(await self._queue(prompt_ids, p, lora, label))
        except BaseException:
            for handle in queued:
                self.engine.abort(handle.id)
            raise
        return queued

    def _lora(self, body: RequestBody) -> str | None:
        """The LoRA adapter ``body.model`` names (None: the served model itself)."""
        if body.model is None or body.model == self.model_name:
            return None
        if body.model not in self.engine.lora_names:
            raise ModelNotFound(f"The model `{body.model}` does not exist.")
        return body.model  # a LoRA adapter of the base model

    def _params(self, body: RequestBody, prompt_len: int, label: str) -> SamplingParams:
        """The engine's sampling parameters of one prompt of ``body``."""
        try:
            return SamplingParams(
                max_tokens=self._max_tokens(body, prompt_len, label),
                temperature=body.temperature,
                top_p=body.top_p,
                ignore_eos=body.ignore_eos,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                seed=body.seed,
                stop=body.stop_strings(),
                logit_bias=body.bias_pairs(),
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logprobs=body.asked_logprobs(),
                n=body.n,
            )
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc), _field(str(exc))) from None

    async def _queue(
        self, ids: list[int], params: SamplingParams, lora: str | None, label: str
    ) -> RequestHandle:
        """One prompt queued in the engine; its refusals name the prompt by ``label``."""
        try:
            return await self.engine.asubmit(ids, params, lora)
        except UnknownAdapter:  # unloaded since it was listed
            raise ModelNotFound(f"The model `{lora}` does not exist.") from None
        except (ValueError, TypeError) as exc:
            message = str(exc)
            field = _field(message)
            if field != "prompt":
                raise BadRequest(message, field) from None
            # The engine numbers the prompts of one call: this call had one.
            if label.startswith("prompt ") and message.startswith("prompt 0"):
                message = label + message[len("prompt 0") :]
            raise BadRequest(message, label.split()[0]) from None

    def _prompt_ids(
        self, body: RequestBody, prompts: list[str | list[int] | None], labels: list[str]
    ) -> list[list[int]]:
        """Each prompt's token ids (a chat's: its messages in the chat template); a
        refusal names the prompt by its label (``_labels``)."""
        if isinstance(body, ChatBody):
            return [self.engine.chat_prompt([m.for_template() for m in body.messages])]
        ids = []
        for prompt, label in zip(prompts, labels, strict=True):
            if isinstance(prompt, list):
                ids.append(prompt)
            elif self.engine.tokenizer is None:
                raise BadRequest(f"{label}: text given but the model has no tokenizer", "prompt")
            elif not prompt:
                raise BadRequest(f"{label}: empty", "prompt")
            else:
                ids.append(self.engine.tokenizer.encode(prompt))
        return ids

    def _max_tokens(self, body: RequestBody, prompt_len: int, label: str) -> int:
        """The tokens to generate at most: those asked for, where the context has room
        for them; by default all the room (chat) or 16 of it (completions). ``label``
        names the prompt ("messages", "prompt", or "prompt 2" of several)."""
        room = self.engine.max_model_len - prompt_len
        if room < 1:
            raise BadRequest(
                f"{label}: {prompt_len} tokens leave no room to answer in the "
                f"context of {self.engine.max_model_len} tokens",
                label.split()[0],
            )
        try:
            asked = body.requested_max_tokens()
        except ValueError as exc:
            raise BadRequest(str(exc), "max_completion_tokens") from None
        if asked is None:
            return room if isinstance(body, ChatBody) else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        if asked > room:
            param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            raise BadRequest(
                f"{param}: {asked} tokens do not fit: {_owner(label)} {prompt_len} tokens leave "
                f"{room} in the context of {self.engine.max_model_len}",
                param,
            )
        return asked

    async def _timed(self, sample: _Sample) -> AsyncIterator[list[int]]:
        """The sample's tokens in chunks (all that arrived since the last), counted, the
        first timed (``Metrics.first_tokens``)."""
        first = True
        async for chunk in sample.handle.chunks():
            if first:
                self.metrics.first_tokens(sample.handle, sample.arrived)
                first = False
            self.metrics.tokens.inc(len(chunk))
            yield chunk

    def _abort(self, requests: Sequence[RequestHandle]) -> None:
        """Ends the requests (every sample); each counted where it was still live."""
        for handle in requests:
            if self.engine.abort(handle.id):
                self.metrics.aborted.inc()

    async def _abort_on_disconnect(
        self, request: Request, requests: Sequence[RequestHandle]
    ) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.1)
        self._abort(requests)

    async def _stream(
        self,
        requests: Sequence[RequestHandle],
        samples: Sequence[_Sample],
        meta: _Meta,
        extras: _Extras,
    ) -> AsyncIterator[str]:
        """Every sample's events (``_sample_events``), each as it comes, then with
        ``usage`` (``stream_options.include_usage``) one more event with no choices
        carrying the response's token counts, then ``[DONE]``. A client that goes away
        mid-stream aborts the requests (every sample)."""
        produced = [0] * len(samples)
        finished = False
        try:
            async for event in self._events(samples, meta, extras, produced):
                yield event
            finished = True
            if extras.usage:
                usage = _usage(extras.prompt_tokens, sum(produced))
                yield _sse({**meta.head(True), "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream
                self._abort(requests)

    async def _events(
        self, samples: Sequence[_Sample], meta: _Meta, extras: _Extras, produced: list[int]
    ) -> AsyncIterator[str]:
        """The samples' events as they come: one sample's straight from it (no task or
        queue between: each event then wakes one task, not two); several merged through
        a queue, a task per sample."""
        if len(samples) == 1:
            async for event in self._sample_events(0, samples[0], meta, extras, produced):
                yield event
            return
        queue: asyncio.Queue[str | None] = asyncio.Queue()

        async def feed(i: int, sample: _Sample) -> None:
            try:
                async for event in self._sample_events(i, sample, meta, extras, produced):
                    queue.put_nowait(event)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(feed(i, s)) for i, s in enumerate(samples)]
        try:
            left = len(tasks)
            while left:
                event = await queue.get()
                if event is None:
                    left -= 1
                else:
                    yield event
            for task in tasks:
                task.result()  # (an engine error ends the stream with it)
        finally:
            for task in tasks:
                task.cancel()

    async def _sample_events(
        self,
        index: int,
        sample: _Sample,
        meta: _Meta,
        extras: _Extras,
        produced: list[int],
    ) -> AsyncIterator[str]:
        """Sample ``index``'s events: one per chunk of tokens whose text is whole (tokens
        that end inside a multi-byte character wait for the rest, and travel with it,
        with their log probabilities where asked); the last carries the finish reason
        and any text still held back; with ``usage`` each has ``usage: null``. No event
        carries a stop string, nor text that may begin one before the next tokens say.
        ``echo`` (the prompt's text) comes first, in an event of its own. A model without
        a tokenizer has no text to wait for: each chunk of token ids is an event.
        A chat's first event names the role. ``produced[index]`` counts the tokens."""
        textless = self.engine.tokenizer is None
        text = TextStream(_no_text if textless else self.engine.decode, extras.stop())
        usage, chunk_of = extras.usage, meta.chunk  # (looked up once: this is per token)
        waiting: list[int] = []
        first = True  # (no event of this sample sent yet)
        if sample.echo:
            yield chunk_of(index, sample.echo, [], None, usage, None, first)
            first = False
        async for chunk in self._timed(sample):
            delta = text.push(chunk)
            waiting += chunk
            produced[index] += len(chunk)
            if delta or textless:
                logprobs = sample.logprobs(produced[index] - len(waiting), waiting)
                yield chunk_of(index, delta, waiting, None, usage, logprobs, first)
                waiting, first = [], False
        logprobs = sample.logprobs(produced[index] - len(waiting), waiting)
        finish = _finish(sample.handle)
        yield chunk_of(index, text.rest(), waiting, finish, usage, logprobs, first)


@dataclass(frozen=True)
class _Sample:
    """One choice of a response: the engine's handle of its sample, the text it begins
    with (``echo``: its prompt's), its log probabilities' shapes (None: not asked) and
    when its request arrived (``time.perf_counter``)."""

    handle: RequestHandle
    echo: str
    shapes: LogprobShapes | None
    arrived: float

    def logprobs(self, start: int, tokens: list[int]) -> dict | None:
        """The ``logprobs`` of an event holding ``tokens``, the ``start``-th token on
        (None where not asked or there are no tokens)."""
        if self.shapes is None or not tokens:
            return None
        return self.shapes.piece(self.handle.logprobs[start : start + len(tokens)])


@dataclass(frozen=True)
class _Extras:
    """What a stream adds to its tokens' text: usage (and the prompts' tokens it counts)
    and stop strings."""

    usage: bool
    stop: Callable[[], StopText | None]  # a fresh matcher per sample
    prompt_tokens: int


class _Meta:
    """The id, creation time, model and route (chat or completions) of one response, and
    its JSON bodies; a choice has ``logprobs`` where the request asked for them."""

    def __init__(self, response_id: str, model: str, chat: bool) -> None:
        self.id, self.model, self.created = response_id, model, int(time.time())
        self.chat = chat

    @functools.cached_property
    def _event_head(self) -> str:
        """A streamed event's head, as JSON without its closing brace: written once per
        streamed response (none for a whole one), so each event encodes its own fields
        only (an event's JSON: 5.9 against 3.9 us on the development machine)."""
        return json.dumps(self.head(True))[:-1]

    def head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": f"{kind}.chunk" if self.chat and chunk else kind,
            "created": self.created,
            "model": self.model,
        }

    def chunk(
        self,
        index: int,
        text: str,
        tokens: list[int],
        finish: str | None,
        usage: bool,
        logprobs: dict | None,
        first: bool,
    ) -> str:
        """A streamed event of sample ``index``, as the server-sent event's text (a
        chat's ``first`` event of a sample names the role, as OpenAI's)."""
        if self.chat:
            delta = {"content": text} if text else {}
            choice = {"index": index, "delta": {"role": "assistant", **delta} if first else delta}
        else:
            choice = {"index": index, "text": text, "token_ids": tokens}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        end = ', "usage": null}' if usage else "}"
        return f'data: {self._event_head}, "choices": {json.dumps([choice])}{end}\n\n'

    def whole(self, answers: Sequence[_Choice], prompt_tokens: int) -> dict:
        """The whole response: one choice per sample, in order, and the usage of all."""
        choices = []
        for index, a in enumerate(answers):
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": a.text}}
            else:
                choice = {"index": index, "text": a.text, "token_ids": a.tokens}
            if a.logprobs is not None:
                choice["logprobs"] = a.logprobs
            choices.append({**choice, "finish_reason": a.finish})
        produced = sum(len(a.tokens) for a in answers)
        return {**self.head(False), "choices": choices, "usage": _usage(prompt_tokens, produced)}


@dataclass(frozen=True)
class _Choice:
    """One sample's whole answer (``Responder._answer``)."""

    text: str
    tokens: list[int]
    finish: str | None
    logprobs: dict | None


def _field(message: str) -> str:
    """The field an engine's refusal names: its first word ("prompt 2: ..." names
    ``prompt``)."""
    return message.split(":", 1)[0].split()[0]


def _labels(chat: bool, prompts: int) -> list[str]:
    """How refusals name each prompt: ``messages`` (chat), ``prompt``, or ``prompt i``
    of several."""
    if chat:
        return ["messages"]
    return ["prompt"] if prompts == 1 else [f"prompt {i}" for i in range(prompts)]


def _owner(label: str) -> str:
    """The possessive of a prompt's label: "the prompt's", "the messages'", "prompt 2's"."""
    if label == "messages":
        return "the messages'"
    return "the prompt's" if label == "prompt" else f"{label}'s"


def _usage(prompt_tokens: int, produced: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": produced,
        "total_tokens": prompt_tokens + produced,
    }


def _finish(handle: RequestHandle) -> str | None:
    reason = handle.finish_reason
    if reason is None:
        return None
    return "length" if reason.value in ("length", "max_model_len") else reason.value


def _no_text(tokens: Sequence[int]) -> str:
    return ""  # a model without a tokenizer streams token ids only


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
