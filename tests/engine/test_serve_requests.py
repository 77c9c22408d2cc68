"""The server's request surface in process (FastAPI's test client) over a test double of
the engine: what is refused and how (400 naming the field, 404 for another model, 413
for a large body, 401 without the key), what is honoured (the token limit and its
default, usage in a stream), and the drain of a stopping server. The real server with
the real model is ``test_serve.py``."""

import asyncio
import json
import random
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from ostinato.engine.api.lora_registry import (  # noqa: E402
    AdapterInUse,
    LoraNotEnabled,
    UnknownAdapter,
)
from ostinato.engine.core.logprob import TokenLogprob  # noqa: E402
from ostinato.engine.core.scheduler import FinishReason  # noqa: E402
from ostinato.engine.loading.peft_adapter import LoraAdapterError  # noqa: E402
from ostinato.engine.serve.app import build_app  # noqa: E402
from ostinato.engine.serve.bodies import NOT_HONOURED  # noqa: E402
from ostinato.engine.serve.loop import RequestHandle  # noqa: E402

MODEL = "test-model"


class Tokenizer:
    chat_template = "{{ messages }}"

    def encode(self, text):
        return [1 + ord(c) % 50 for c in text]


class Engine:
    """Answers every request with ``max_tokens`` tokens of id 7, finish reason length."""

    max_model_len = 64

    def __init__(self):
        self.tokenizer = Tokenizer()
        self.submitted = []
        self.loras = []
        self.lora_names = ["tuned"]
        self.lora_refusals = {}  # a path or name -> what the engine raises for it

    async def asubmit(self, prompt, params=None, lora=None):
        self.submitted.append((list(prompt), params))
        self.loras.append(lora)
        handle = RequestHandle(
            f"req-{len(self.submitted)}", list(prompt), asyncio.get_running_loop()
        )
        for _ in range(params.max_tokens):
            handle._put([7])
        handle._end(FinishReason.LENGTH)
        return handle

    def abort(self, request_id):
        return True

    async def aload_lora(self, name, path):
        if path in self.lora_refusals:
            raise self.lora_refusals[path]
        self.lora_names = [*self.lora_names, name]

    async def aunload_lora(self, name):
        if name in self.lora_refusals:
            raise self.lora_refusals[name]
        if name not in self.lora_names:
            raise UnknownAdapter(f"lora: no adapter named {name!r}")
        self.lora_names = [n for n in self.lora_names if n != name]

    def status(self):
        raise AssertionError("not asked here")

    def decode(self, token_ids):
        return "x" * len(token_ids)

    def chat_prompt(self, messages):
        return [3] * sum(len(m["content"]) for m in messages)


@pytest.fixture
def engine():
    return Engine()


def client(engine, **kw):
    return TestClient(build_app(engine, MODEL, **kw))


def chat(c, **body):
    body = {"messages": [{"role": "user", "content": "hello"}], **body}
    return c.post("/v1/chat/completions", json=body)


def complete(c, **body):
    return c.post("/v1/completions", json={"prompt": "hello", **body})


def refused(response, param, status=400):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error


def test_an_unknown_field_is_refused_by_name(engine):
    c = client(engine)
    error = refused(chat(c, temprature=0.5), "temprature")
    assert "not a parameter" in error["message"]
    refused(complete(c, messages=[]), "messages")  # a chat field on completions
    assert not engine.submitted


CHAT_ONLY = {"tools", "tool_choice", "parallel_tool_calls", "response_format"}
COMPLETIONS_ONLY = {"echo", "suffix", "best_of"}
ASKING = {
    "suffix": ("end", None),
    "best_of": (2, 1),
    "tools": ([{"type": "function"}], None),
    "tool_choice": ("auto", "none"),
    "parallel_tool_calls": (True, None),
    "response_format": ({"type": "json_object"}, {"type": "text"}),
}


@pytest.mark.parametrize("field", sorted(NOT_HONOURED))
def test_what_is_not_honoured_is_refused_by_name_and_its_no_op_accepted(engine, field):
    asking, no_op = ASKING[field]
    send = complete if field in COMPLETIONS_ONLY else chat
    c = client(engine)
    error = refused(send(c, **{field: asking}), field)
    assert "not supported by this server" in error["message"]
    assert not engine.submitted
    assert send(c, max_tokens=2, **{field: no_op}).status_code == 200


def test_logprobs_reach_the_engine_in_both_shapes(engine):
    c = client(engine)
    assert chat(c, logprobs=True, top_logprobs=4, max_tokens=1).status_code == 200
    assert engine.submitted[-1][1].logprobs == 4
    assert chat(c, logprobs=True, max_tokens=1).status_code == 200
    assert engine.submitted[-1][1].logprobs == 0
    assert chat(c, logprobs=False, max_tokens=1).status_code == 200
    assert engine.submitted[-1][1].logprobs is None
    assert complete(c, logprobs=2, max_tokens=1).status_code == 200
    assert engine.submitted[-1][1].logprobs == 2
    submitted = len(engine.submitted)
    refused(chat(c, top_logprobs=2), "top_logprobs")  # (needs logprobs: true)
    refused(chat(c, logprobs=True, top_logprobs=21), "top_logprobs")
    refused(complete(c, logprobs=2, echo=True), "logprobs")
    refused(complete(c, logprobs=-1), "logprobs")
    assert len(engine.submitted) == submitted


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(stream="yes"), "stream"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role"),
        (dict(messages=[{"role": "user", "content": "hi", "name": "x"}]), "messages.0.name"),
        (dict(stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
        # Numbers are numbers, as OpenAI checks them: no string, no bool.
        (dict(temperature="0.5"), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_p="1"), "top_p"),
        (dict(presence_penalty="1"), "presence_penalty"),
        (dict(logit_bias={"7": "5"}), "logit_bias.7"),
        (dict(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
        (dict(messages=[{"role": "user", "content": []}]), "messages.0.content"),
    ],
)
def test_types_are_strict(engine, body, param):
    refused(chat(client(engine), **body), param)
    assert not engine.submitted


@pytest.mark.parametrize(
    "prompt", [[1, "a"], ["a", [1]], [[1], "a"], [1.5], [[True]], {"text": "a"}, None, 5]
)
def test_a_prompt_of_no_openai_shape_is_refused_by_name(engine, prompt):
    error = refused(complete(client(engine), prompt=prompt), "prompt")
    assert "a list of token-id lists" in error["message"] or prompt is None, error
    assert not engine.submitted


def test_null_stands_for_a_field_s_default_as_in_openai(engine):
    c = client(engine)
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "presence_penalty", "seed"))
    assert chat(c, max_tokens=1, **nulls).status_code == 200
    params = engine.submitted[-1][1]
    assert (params.temperature, params.top_p, params.n, params.seed) == (1.0, 1.0, 1, None)
    assert complete(c, max_tokens=1, echo=None, logprobs=None).status_code == 200
    refused(chat(c, messages=None), "messages")  # required: no default to stand for
    refused(chat(c, temprature=None), "temprature")  # unknown, whatever its value


def test_stream_options_without_stream_is_refused_by_name(engine):
    c = client(engine)
    refused(chat(c, stream_options={"include_usage": True}), "stream_options")
    refused(complete(c, stream=False, stream_options={"include_usage": False}), "stream_options")
    assert not engine.submitted
    assert chat(c, stream_options=None, max_tokens=1).status_code == 200


class Messages(Engine):
    """Records the messages the chat template was given."""

    def chat_prompt(self, messages):
        self.messages = messages
        return super().chat_prompt(messages)


def test_text_parts_and_the_developer_role_reach_the_chat_template():
    engine = Messages()
    c = client(engine)
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}]
    assert chat(c, messages=messages, max_tokens=1).status_code == 200
    assert engine.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one\ntwo"},  # (joined as vLLM joins them)
    ]
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    error = refused(chat(c, messages=[{"role": "user", "content": [image]}]), "messages.0.content")
    assert "'image_url' parts are not supported" in error["message"]
    odd = {"type": "text", "text": "a", "cache": 1}
    refused(chat(c, messages=[{"role": "user", "content": [odd]}]), "messages.0.content")
    assert len(engine.submitted) == 1


def test_a_lora_adapter_is_a_model_of_its_own(engine):
    c = client(engine)
    cards = c.get("/v1/models").json()["data"]
    assert [m["id"] for m in cards] == [MODEL, "tuned"] and cards[1]["parent"] == MODEL
    for model in (MODEL, "tuned"):
        r = c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    assert engine.loras == [None, "tuned"]
    r = c.post("/v1/completions", json={"model": "tuned2", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_model_is_retrieved_by_its_id_as_openai_s_models_retrieve(engine):
    c = client(engine)
    assert c.get(f"/v1/models/{MODEL}").json() == c.get("/v1/models").json()["data"][0]
    assert c.get("/v1/models/tuned").json()["parent"] == MODEL  # a LoRA adapter's card
    error = refused(c.get("/v1/models/gpt-4o"), "model", 404)
    assert error["code"] == "model_not_found"


def test_another_model_is_404_model_not_found(engine):
    c = client(engine)
    error = refused(chat(c, model="gpt-4o"), "model", 404)
    assert error["code"] == "model_not_found" and "gpt-4o" in error["message"]
    assert chat(c, model=MODEL, max_tokens=1).status_code == 200
    assert chat(c, max_tokens=1).status_code == 200  # no model named: the one served


def test_the_token_limit_its_alias_and_its_default(engine):
    c = client(engine)
    prompt = 5  # "hello": the test double's chat template gives one id a character
    body = chat(c).json()  # chat: the room left in the context
    assert body["usage"]["completion_tokens"] == engine.max_model_len - prompt
    assert complete(c).json()["usage"]["completion_tokens"] == 16  # OpenAI's default
    assert chat(c, max_completion_tokens=3).json()["usage"]["completion_tokens"] == 3
    assert chat(c, max_tokens=4, max_completion_tokens=4).status_code == 200
    refused(chat(c, max_tokens=4, max_completion_tokens=5), "max_completion_tokens")
    error = refused(chat(c, max_tokens=engine.max_model_len), "max_tokens")
    assert "leave 59" in error["message"]
    refused(chat(c, max_completion_tokens=60), "max_completion_tokens")
    long = [{"role": "user", "content": "x" * engine.max_model_len}]
    refused(chat(c, messages=long), "messages")
    refused(complete(c, prompt="y" * 70), "prompt")
    refused(complete(c, prompt=""), "prompt")


def test_a_stream_reports_its_usage_when_asked(engine):
    c = client(engine)
    lines = chat(c, stream=True, max_tokens=3, stream_options={"include_usage": True}).text
    events = [ln[6:] for ln in lines.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    import json

    *chunks, usage = [json.loads(e) for e in events[:-1]]
    assert all(ch["usage"] is None and ch["choices"] for ch in chunks)
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8
    }  # fmt: skip
    plain = chat(c, stream=True, max_tokens=3).text
    assert '"usage"' not in plain


def test_a_large_body_is_refused_before_it_is_parsed(engine):
    c = client(engine, max_body_bytes=1000)
    big = "z" * 2000
    refused(complete(c, prompt=big), None, 413)
    # without a length, counted as it streams
    chunks = iter([b'{"prompt": "', big.encode(), b'"}'])
    response = c.post(
        "/v1/completions", content=chunks, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    assert complete(c, prompt="small", max_tokens=1).status_code == 200
    assert not [p for p, _ in engine.submitted if len(p) > 100]


def test_with_a_key_every_route_but_health_needs_it(engine):
    c = client(engine, api_key="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = c.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers
        )
        error = refused(response, None, 401)
        assert error["code"] == "invalid_api_key"
    assert c.get("/v1/models").status_code == 401
    good = {"Authorization": "Bearer s3cret"}
    assert c.get("/v1/models", headers=good).status_code == 200
    assert complete(c, max_tokens=1, **{}).status_code == 401
    response = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=good)
    assert response.status_code == 200


def test_binding_beyond_loopback_without_a_key_is_flagged():
    from ostinato.engine.serve.server import exposed_without_key

    assert not exposed_without_key("127.0.0.1", None)
    assert not exposed_without_key("::1", None)
    assert not exposed_without_key("localhost", None)
    assert exposed_without_key("0.0.0.0", None)
    assert exposed_without_key("myhost.example", None)
    assert not exposed_without_key("0.0.0.0", "key")


def test_a_stopping_server_aborts_what_is_left_after_its_grace_or_at_a_second_signal():
    import signal

    import uvicorn

    from ostinato.engine.serve.server import DrainingServer

    aborted = threading.Event()
    calls = []

    def abort_all():
        calls.append(1)
        aborted.set()

    config = uvicorn.Config(lambda *a: None)
    server = DrainingServer(config, abort_all, grace=0.2)
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and not server.force_exit and not calls
    assert aborted.wait(5) and calls == [1]  # after the grace period
    server = DrainingServer(config, abort_all, grace=60)
    server.handle_exit(signal.SIGINT, None)
    server.handle_exit(signal.SIGINT, None)  # a second signal: at once, not forced
    assert calls == [1, 1] and not server.force_exit


def test_penalties_reach_the_engine_within_openais_range(engine):
    c = client(engine)
    body = dict(max_tokens=1, presence_penalty=0.5, frequency_penalty=-1.25)
    assert chat(c, **body).status_code == 200
    params = engine.submitted[-1][1]
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.25)
    assert complete(c, **body).status_code == 200
    assert engine.submitted[-1][1].frequency_penalty == -1.25
    submitted = len(engine.submitted)
    refused(chat(c, presence_penalty=2.5), "presence_penalty")
    refused(complete(c, frequency_penalty=-3), "frequency_penalty")
    assert len(engine.submitted) == submitted


def test_stop_token_ids_reach_the_engine(engine):
    c = client(engine)
    assert complete(c, stop_token_ids=[7, 12], max_tokens=1).status_code == 200
    assert engine.submitted[-1][1].stop_token_ids == (7, 12)
    assert chat(c, stop_token_ids=None, max_tokens=1).status_code == 200
    assert engine.submitted[-1][1].stop_token_ids == ()
    submitted = len(engine.submitted)
    for bad in ([-1], [5, "7"], [1.5], [True]):  # (the param names the element)
        refused(chat(c, stop_token_ids=bad), f"stop_token_ids.{len(bad) - 1}")
    refused(chat(c, stop_token_ids=7), "stop_token_ids")
    assert len(engine.submitted) == submitted


def test_a_seed_reaches_the_engine(engine):
    c = client(engine)
    assert chat(c, seed=3, max_tokens=1, temperature=1.0).status_code == 200
    assert engine.submitted[-1][1].seed == 3
    refused(chat(c, seed=-1), "seed")
    refused(chat(c, seed="3"), "seed")


class Letters(Engine):
    """Answers with tokens 1, 2, 3, ... whose text is a, b, c, ... (it stops at nothing
    itself: the server's own cut is what is tested)."""

    async def asubmit(self, prompt, params=None, lora=None):
        self.submitted.append((list(prompt), params))
        handle = RequestHandle(
            f"req-{len(self.submitted)}", list(prompt), asyncio.get_running_loop()
        )
        for t in range(1, params.max_tokens + 1):
            handle._put([t])
        handle._end(FinishReason.STOP)
        return handle

    def decode(self, token_ids):
        return "".join(chr(96 + t) for t in token_ids)


def test_stop_strings_reach_the_engine_and_no_answer_shows_one():
    engine = Letters()
    c = client(engine)
    body = chat(c, max_tokens=8, stop=["de", "zz"]).json()
    assert engine.submitted[-1][1].stop == ("de", "zz")
    assert body["choices"][0]["message"]["content"] == "abc"
    stream = chat(c, max_tokens=8, stop="de", stream=True).text
    import json

    events = [json.loads(ln[6:]) for ln in stream.splitlines() if ln.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "abc"
    refused(chat(c, stop=["a", "b", "c", "d", "e"]), "stop")  # at most 4, as OpenAI


def test_echo_puts_the_prompt_first_whole_and_streamed():
    engine = Letters()
    c = client(engine)
    whole = complete(c, prompt="hi ", echo=True, max_tokens=3).json()
    assert whole["choices"][0]["text"] == "hi abc"
    assert whole["usage"]["completion_tokens"] == 3
    import json

    stream = complete(c, prompt="hi ", echo=True, max_tokens=3, stream=True).text
    events = [json.loads(ln[6:]) for ln in stream.splitlines() if ln.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == "hi abc"
    ids = complete(c, prompt=[1, 2], echo=True, max_tokens=1).json()
    assert ids["choices"][0]["text"] == "aba"  # token ids: their text
    refused(chat(c, echo=True), "echo")  # a completions field


def test_a_logit_bias_reaches_the_engine_as_token_ids(engine):
    c = client(engine)
    assert chat(c, logit_bias={"7": 5, "12": -100}, max_tokens=1).status_code == 200
    assert engine.submitted[-1][1].logit_bias == ((7, 5.0), (12, -100.0))
    refused(chat(c, logit_bias={"x": 1}), "logit_bias")
    refused(chat(c, logit_bias={"7": 101}), "logit_bias")


class TextlessEngine(Engine):
    """No tokenizer; its tokens (ids 10, 11, ...) arrive one by one, 100 ms apart (apart
    enough that a busy machine's reader still sees them one by one)."""

    def __init__(self):
        super().__init__()
        self.tokenizer = None

    async def asubmit(self, prompt, params=None, lora=None):
        self.submitted.append((list(prompt), params))
        aloop = asyncio.get_running_loop()
        handle = RequestHandle(f"req-{len(self.submitted)}", list(prompt), aloop)
        for i in range(params.max_tokens):
            aloop.call_later(0.1 * (i + 1), handle._put, [10 + i])
        aloop.call_later(0.1 * (params.max_tokens + 1), handle._end, FinishReason.LENGTH)
        return handle


def test_a_model_without_a_tokenizer_streams_its_token_ids_as_they_come():
    # No text to wait for: each arrival is an event (not the whole answer at the end).
    import json

    stream = complete(client(TextlessEngine()), prompt=[1, 2, 3], max_tokens=4, stream=True).text
    events = [json.loads(ln[6:]) for ln in stream.splitlines() if ln.startswith("data: {")]
    ids = [e["choices"][0]["token_ids"] for e in events]
    assert [t for chunk in ids for t in chunk] == [10, 11, 12, 13]
    assert sum(1 for chunk in ids if chunk) >= 3, ids


class Samples(Letters):
    """``Letters`` per sample: sample i answers with tokens i + 1, i + 2, ... (its own
    handle among the first one's ``others``), finish reason stop."""

    async def asubmit(self, prompt, params=None, lora=None):
        self.submitted.append((list(prompt), params))
        aloop = asyncio.get_running_loop()
        rid = f"req-{len(self.submitted)}"
        handle = RequestHandle(rid, list(prompt), aloop)
        handle.others = [
            RequestHandle(f"{rid}#{i}", list(prompt), aloop) for i in range(1, params.n)
        ]
        for i, h in enumerate(handle.samples):
            for t in range(i + 1, i + 1 + params.max_tokens):
                h._put([t])
            h._end(FinishReason.STOP)
        return handle


def test_n_samples_come_back_as_choices_whole_and_streamed():
    engine = Samples()
    c = client(engine)
    whole = complete(c, n=3, max_tokens=2).json()
    assert engine.submitted[-1][1].n == 3
    assert [(ch["index"], ch["text"]) for ch in whole["choices"]] == [
        (0, "ab"),
        (1, "bc"),
        (2, "cd"),
    ]
    assert whole["usage"]["completion_tokens"] == 6
    answer = chat(c, n=2, max_tokens=3).json()["choices"]
    assert [ch["message"]["content"] for ch in answer] == ["abc", "bcd"]
    with c.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "n": 3,
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        events = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
        ]
    texts, finishes = ["", "", ""], [None] * 3
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        finishes[choice["index"]] = choice["finish_reason"] or finishes[choice["index"]]
    assert texts == ["ab", "bc", "cd"] and finishes == ["stop"] * 3
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    refused(complete(c, n=0), "n")
    refused(complete(c, n=129), "n")


def stream_events(c, route, body):
    with c.stream("POST", route, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(ln[6:]) for ln in response.iter_lines() if ln.startswith("data: {")]


def test_several_prompts_are_one_request_each_their_choices_prompt_by_prompt():
    engine = Samples()
    c = client(engine)
    body = complete(c, prompt=["hi", "there"], n=2, max_tokens=2, echo=True).json()
    assert [p for p, _ in engine.submitted] == [
        Tokenizer().encode("hi"),
        Tokenizer().encode("there"),
    ]
    assert [(ch["index"], ch["text"]) for ch in body["choices"]] == [
        (0, "hiab"), (1, "hibc"), (2, "thereab"), (3, "therebc")
    ]  # fmt: skip
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}
    ids = complete(c, prompt=[[5, 6], [7]], max_tokens=1).json()
    assert [ch["text"] for ch in ids["choices"]] == ["a", "a"]
    assert engine.submitted[-2:] == [
        ([5, 6], engine.submitted[-2][1]),
        ([7], engine.submitted[-1][1]),
    ]
    assert ids["usage"]["prompt_tokens"] == 3
    events = stream_events(
        c, "/v1/completions",
        {"prompt": [[5], [6]], "n": 2, "max_tokens": 2, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    texts = ["", "", "", ""]
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == ["ab", "bc", "ab", "bc"]
    assert events[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}


class Refusing(Samples):
    """Refuses a prompt holding token 99 as the engine refuses what is out of its
    vocabulary; records what was aborted."""

    def __init__(self):
        super().__init__()
        self.aborted = []

    async def asubmit(self, prompt, params=None, lora=None):
        if 99 in prompt:
            raise ValueError("prompt 0: token ids [99] outside the vocabulary [0, 50)")
        return await super().asubmit(prompt, params, lora)

    def abort(self, request_id):
        self.aborted.append(request_id)
        return True


def test_several_prompts_are_queued_all_or_none_and_a_refusal_names_its_prompt():
    engine = Refusing()
    c = client(engine)
    error = refused(complete(c, prompt=[[1], [2], [99]], max_tokens=1), "prompt")
    assert error["message"].startswith("prompt 2: token ids [99]")
    assert engine.aborted == ["req-1", "req-2"]  # the two queued before it
    error = refused(complete(c, prompt=["ok", "y" * 70], max_tokens=1), "prompt")
    assert error["message"].startswith("prompt 1: 70 tokens leave no room")
    error = refused(complete(c, prompt=["ok", ""]), "prompt")
    assert error["message"] == "prompt 1: empty"
    error = refused(complete(c, prompt=["ok", "fine"], max_tokens=62), "max_tokens")
    assert "prompt 1's 4 tokens leave 60" in error["message"]
    assert len(engine.submitted) == 2  # (the first call's two; none after)
    refused(complete(c, prompt=[[1]] * 65, n=2), "prompt")  # 130 choices, over 128


class Logprobs(Samples):
    """``Samples`` with a log probability per token (sample i's token t: -t / 10)."""

    async def asubmit(self, prompt, params=None, lora=None):
        handle = await super().asubmit(prompt, params, lora)
        for i, h in enumerate(handle.samples):
            h.logprobs = [TokenLogprob(t, -t / 10) for t in range(i + 1, i + 1 + params.max_tokens)]
        return handle


def test_each_choice_s_text_offsets_start_at_its_own_text():
    c = client(Logprobs())
    whole = complete(c, prompt="hi", n=2, max_tokens=3, logprobs=0).json()["choices"]
    assert [ch["logprobs"]["text_offset"] for ch in whole] == [[0, 1, 2], [0, 1, 2]]
    assert [ch["logprobs"]["tokens"] for ch in whole] == [["a", "b", "c"], ["b", "c", "d"]]
    events = stream_events(
        c, "/v1/completions", {"prompt": "hi", "n": 2, "max_tokens": 3, "logprobs": 0}
    )
    offsets = [[], []]
    for event in events:
        (choice,) = event["choices"]
        if choice.get("logprobs"):
            offsets[choice["index"]] += choice["logprobs"]["text_offset"]
    assert offsets == [[0, 1, 2], [0, 1, 2]]


def test_a_chat_stream_names_the_role_in_each_choice_s_first_event():
    events = stream_events(
        client(Samples()), "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2},
    )  # fmt: skip
    roles = [(e["choices"][0]["index"], e["choices"][0]["delta"].get("role")) for e in events]
    assert [r for _, r in roles if r is not None] == ["assistant", "assistant"]
    for index in (0, 1):
        mine = [r for i, r in roles if i == index]
        assert mine[0] == "assistant" and set(mine[1:]) == {None}


def load_lora(c, **body):
    return c.post("/v1/load_lora_adapter", json=body)


def unload_lora(c, **body):
    return c.post("/v1/unload_lora_adapter", json=body)


def model_ids(c):
    return [m["id"] for m in c.get("/v1/models").json()["data"]]


def test_adapters_load_and_unload_at_run_time_only_where_the_server_allows_it(engine):
    off = client(engine)
    asked = (
        load_lora(off, lora_name="a", lora_path="/x"),
        unload_lora(off, lora_name="tuned"),
        load_lora(off, lora_inplace="?"),  # whatever the body says
    )
    for response in asked:
        assert response.status_code == 403, response.text
        error = response.json()["error"]
        assert error["code"] == "runtime_lora_disabled"
        assert "--allow-runtime-lora" in error["message"]
    assert engine.lora_names == ["tuned"]
    c = client(engine, runtime_lora=True)
    ok = load_lora(c, lora_name="calm", lora_path="/adapters/calm")
    assert ok.status_code == 200 and "'calm' added" in ok.text
    assert model_ids(c) == [MODEL, "tuned", "calm"]
    assert complete(c, model="calm", max_tokens=2).status_code == 200
    assert engine.loras[-1] == "calm"  # routed to the adapter it loaded
    gone = unload_lora(c, lora_name="calm")
    assert gone.status_code == 200 and "'calm' removed" in gone.text
    assert model_ids(c) == [MODEL, "tuned"]
    assert complete(c, model="calm", max_tokens=2).status_code == 404


def test_what_the_lora_routes_refuse_names_its_field(engine):
    c = client(engine, runtime_lora=True)
    refused(load_lora(c, lora_name="a", lora_path="/x", load_inplace=True), "load_inplace")
    refused(unload_lora(c, lora_name="tuned", lora_int_id=1), "lora_int_id")
    refused(load_lora(c, lora_name="", lora_path="/x"), "lora_name")
    refused(load_lora(c, lora_name=3, lora_path="/x"), "lora_name")
    refused(load_lora(c, lora_name="a"), "lora_path")
    error = refused(load_lora(c, lora_name=MODEL, lora_path="/x"), "lora_name")
    assert "served model" in error["message"]
    engine.lora_refusals = {
        "/big": LoraAdapterError("LoRA adapter 'a': rank 64 exceeds max_lora_rank=16"),
        "/taken": ValueError("lora: an adapter named 'tuned' is loaded; unload it first"),
        "/off": LoraNotEnabled("load_lora: this engine was built without LoRA"),
        "busy": AdapterInUse("unload_lora: 'busy' is in use by running requests"),
        "/broken": RuntimeError("Error while deserializing header: HeaderTooLarge"),
    }
    error = refused(load_lora(c, lora_name="b", lora_path="/broken"), "lora_path")
    assert "could not be read" in error["message"] and "HeaderTooLarge" in error["message"]
    error = refused(load_lora(c, lora_name="a", lora_path="/big"), "lora_path")
    assert "rank 64" in error["message"]
    refused(load_lora(c, lora_name="tuned", lora_path="/taken"), "lora_name")
    error = refused(load_lora(c, lora_name="a", lora_path="/off"), None)
    assert "--enable-lora" in error["message"]
    error = refused(unload_lora(c, lora_name="never"), "lora_name", 404)
    assert error["code"] == "model_not_found"
    refused(unload_lora(c, lora_name="busy"), "lora_name", 409)
    assert engine.lora_names == ["tuned"]


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"prompt": ', "body: not JSON (Expecting value at character 11)"),
        (b"", "body: a JSON object is required"),
        (b"[1, 2]", "body: a JSON object is required"),
        (b'"hello"', "body: a JSON object is required"),
    ],
)
def test_a_body_that_is_no_json_object_is_refused_as_such(engine, content, message):
    r = client(engine).post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"] == {
        "message": message, "type": "invalid_request_error", "param": None, "code": None
    }  # fmt: skip
    assert not engine.submitted


def test_an_unknown_route_or_method_answers_in_openai_s_error_shape(engine):
    c = client(engine)
    missing = c.post("/v1/nothing", json={})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Not Found (POST /v1/nothing)"
    wrong = c.get("/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["type"] == "invalid_request_error"


class Stopped(Engine):
    async def asubmit(self, prompt, params=None, lora=None):
        raise RuntimeError("submit: the engine loop is stopped")


def test_a_fault_of_the_server_s_is_a_500_in_openai_s_error_shape():
    c = TestClient(build_app(Stopped(), MODEL), raise_server_exceptions=False)
    r = complete(c, max_tokens=1)
    assert r.status_code == 500 and r.json()["error"] == {
        "message": "internal error: RuntimeError: submit: the engine loop is stopped",
        "type": "server_error", "param": None, "code": None,
    }  # fmt: skip


class FailingSecond(Refusing):
    """The second request queued fails in the engine; the first never ends by itself."""

    async def asubmit(self, prompt, params=None, lora=None):
        self.submitted.append((list(prompt), params))
        rid = f"req-{len(self.submitted)}"
        handle = RequestHandle(rid, list(prompt), asyncio.get_running_loop())
        if len(self.submitted) == 2:
            handle._end(None, RuntimeError("the engine failed"))
        return handle


def test_a_failed_request_of_several_ends_the_others():
    engine = FailingSecond()
    c = TestClient(build_app(engine, MODEL), raise_server_exceptions=False)
    r = complete(c, prompt=[[1], [2]], max_tokens=1)
    assert r.status_code == 500 and "the engine failed" in r.json()["error"]["message"]
    assert engine.aborted == ["req-1", "req-2"]


FUZZ_VALUES = [
    None, True, False, 0, 1, -1, 2, 3.5, -0.5, 1e300, float("inf"), "", "x", "7", [], [1],
    [[1]], ["a"], {}, {"a": 1}, {"7": 1}, 2**70, 128, 129, 20, 21,
]  # fmt: skip
FUZZ_FIELDS = [
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "ignore_eos", "stop_token_ids", "user", "seed", "stop", "logit_bias",
    "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "echo", "suffix",
    "best_of", "tools", "tool_choice", "response_format", "parallel_tool_calls", "prompt",
    "messages", "bogus",
]  # fmt: skip


def _fuzzed_body(rng, chat: bool) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    body["max_tokens"] = 2
    for _ in range(rng.randint(1, 4)):
        field, value = rng.choice(FUZZ_FIELDS), rng.choice(FUZZ_VALUES)
        if field == "messages" and rng.random() < 0.5:
            content = rng.choice([*FUZZ_VALUES, [{"type": "text", "text": "a"}], [{"type": "x"}]])
            role = rng.choice(["user", "system", "developer", "tool", 1])
            value = [{"role": role, "content": content}]
        if field == "stream_options" and rng.random() < 0.5:
            value = {"include_usage": rng.choice(FUZZ_VALUES)}
        body[field] = value
    return body


@pytest.mark.parametrize("seed", range(4))
def test_no_body_is_a_server_fault_and_every_refusal_is_in_openai_s_shape(seed):
    # Random bodies of OpenAI's fields with values of every type: each is answered (200),
    # refused (400 naming its field in OpenAI's error shape) or not found (404), never a
    # 500.
    rng = random.Random(seed)
    c = TestClient(build_app(Samples(), MODEL), raise_server_exceptions=False)
    seen = set()
    for _ in range(300):
        chat_route = rng.random() < 0.5
        body = _fuzzed_body(rng, chat_route)
        route = "/v1/chat/completions" if chat_route else "/v1/completions"
        r = c.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 404), (body, r.text)
        seen.add(r.status_code)
        if r.status_code != 200:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert {200, 400} <= seen


def test_the_time_to_first_tokens_is_split_where_the_request_waited(engine, monkeypatch):
    # The engine's timing of each request (queue, prefill) reaches its histograms as it
    # was given; the time to first tokens and the accept count once a request, whole or
    # streamed, and the first holds the second (it starts at the same arrival, later).
    from prometheus_client.parser import text_string_to_metric_families

    from ostinato.engine.serve.app import EngineCollector
    from ostinato.engine.serve.loop import EngineTiming

    monkeypatch.setattr(EngineCollector, "collect", lambda self: iter(()))  # (no status here)
    given, plain = [EngineTiming(0.25, 0.5), EngineTiming(0.125, 2.0)], engine.asubmit

    async def asubmit(prompt, params=None, lora=None):
        handle = await plain(prompt, params, lora)
        handle.timing = given[len(engine.submitted) - 1]
        return handle

    engine.asubmit = asubmit
    c = client(engine)
    assert complete(c, max_tokens=2).status_code == 200
    streamed = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(c.get("/metrics").text)
        for s in family.samples
    }
    name = "ostinato_{}_seconds_{}".format
    assert samples[name("request_queue", "sum")] == 0.375
    assert samples[name("request_prefill", "sum")] == 2.5
    for kind in ("request_queue", "request_prefill", "time_to_first_token", "request_accept"):
        assert samples[name(kind, "count")] == 2, kind
    ttft, accept = (
        samples[name("time_to_first_token", "sum")],
        samples[name("request_accept", "sum")],
    )
    assert ttft >= accept > 0
