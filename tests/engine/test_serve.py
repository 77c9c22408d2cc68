"""`ostinato serve` as a real process on 127.0.0.1 with SmolLM2-135M-Instruct on the CPU,
talked to with the official `openai` client: completions, chat, streaming, an abort by
disconnect, bad requests, health and metrics; then stopped."""

import signal
import time

import pytest
from smollm2 import gguf_path

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serve_harness import (  # noqa: E402
    all_blocks_free,
    metric,
    served,
    serving_process,
    wait_for_abort,
)

from ostinato.engine import LLM, SamplingParams  # noqa: E402

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server():
    gguf_path()
    with served(["--device", "cpu", "--max-model-len", "512", "--quiet"]) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM(device="cpu", max_model_len=512, max_num_seqs=4, progress=False)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    assert client.models.retrieve("smollm2-135m").id == "smollm2-135m"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["graphs"] == "ready"


def test_completion_equals_offline_greedy(client, offline):
    prompt = "The history of the Roman Empire begins with"
    got = client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0
    )
    (want,) = offline.generate([prompt], SamplingParams(max_tokens=12))
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.token_ids)


def test_stop_token_ids_end_the_answer_as_offline(client, offline):
    # vLLM's extension: the answer ends with the first of these tokens, finish reason stop.
    prompt = "The history of the Roman Empire begins with"
    (free,) = offline.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    ids = free.token_ids
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    params = SamplingParams(max_tokens=12, stop_token_ids=(ids[at],))
    (want,) = offline.generate([prompt], params)
    got = client.completions.create(
        model="smollm2-135m",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [ids[at]]},
    )
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == at + 1
    assert got.choices[0].text == want.text and want.token_ids == ids[: at + 1]


def test_chat_plain_and_streamed_agree(client):
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=16, temperature=0
    )
    text = whole.choices[0].message.content
    assert "Paris" in text and whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream]
    assert "".join(pieces) == text


def test_logprobs_through_the_client_equal_offline(client, offline):
    # Chat (whole and streamed) and completions, each in OpenAI's shape, their values
    # the offline engine's for the same greedy tokens.
    messages = [{"role": "user", "content": QUESTION}]
    kw = dict(model="smollm2-135m", max_tokens=6, temperature=0)
    (want,) = offline.chat([messages], SamplingParams(max_tokens=6, logprobs=3))
    whole = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3, **kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == len(want.token_ids) == len(want.logprobs)
    for entry, lp in zip(content, want.logprobs, strict=True):
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [v for _, v in lp.top], abs=1e-3
        )
        assert entry.token == offline.decode([lp.token_id])
        assert bytes(entry.bytes).decode() == entry.token
    streamed = client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=3, stream=True, **kw
    )
    pieces = [e for c in streamed if c.choices and c.choices[0].logprobs
              for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [e.logprob for e in pieces] == [e.logprob for e in content]
    prompt = "The history of the Roman Empire begins with"
    (want,) = offline.generate([prompt], SamplingParams(max_tokens=6, logprobs=2))
    got = client.completions.create(prompt=prompt, logprobs=2, **kw).choices[0]
    assert got.logprobs.token_logprobs == pytest.approx(
        [lp.logprob for lp in want.logprobs], abs=1e-3
    )
    assert "".join(got.logprobs.tokens) == got.text
    assert got.logprobs.text_offset[0] == 0 and all(len(d) == 2 for d in got.logprobs.top_logprobs)


def test_a_streaming_client_that_disconnects_aborts_its_request(client, server):
    before = metric(server, "ostinato_aborted_requests_total")
    stream = client.completions.create(
        model="smollm2-135m", prompt="Once upon a time", max_tokens=400, temperature=0, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    wait_for_abort(server, before)


def test_a_waiting_client_that_goes_away_aborts_its_request(server):
    before = metric(server, "ostinato_aborted_requests_total")
    body = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 400}
    with pytest.raises(httpx.TimeoutException):  # the client gives up and hangs up
        httpx.post(f"{server}/v1/completions", json=body, timeout=1.0)
    wait_for_abort(server, before)
    assert all_blocks_free(server)


def test_metrics_count_steps_by_how_they_ran(client, server):
    client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=3)
    # On the CPU nothing is captured: every step is eager, for want of a graph.
    assert metric(server, 'ostinato_eager_steps_total{reason="no_graph_for_batch"}') >= 3
    assert metric(server, "ostinato_graph_padded_rows_total") == 0
    assert metric(server, "ostinato_graph_checked_replays_total") == 0
    assert metric(server, "ostinato_graph_demoted_buckets") == 0
    assert metric(server, "ostinato_generated_tokens_total") >= 3


def test_metrics_say_how_busy_the_engine_was(client, server):
    before = [metric(server, f"ostinato_engine_{m}_total") for m in ("busy_seconds", "tokens")]
    published = metric(server, "ostinato_engine_publish_seconds_total")
    client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=3)
    busy, tokens = (
        metric(server, f"ostinato_engine_{m}_total") for m in ("busy_seconds", "tokens")
    )
    assert busy > before[0] and tokens - before[1] >= 3
    assert metric(server, "ostinato_engine_publish_seconds_total") > published


def test_metrics_say_how_busy_the_http_process_was_and_how_often_it_collected(client, server):
    # (prometheus_client's own process and collector series, as its default registry has
    # them: serve_load reads the CPU seconds to tell a saturated event loop.)
    before = metric(server, "process_cpu_seconds_total")
    for _ in range(3):
        client.completions.create(model="smollm2-135m", prompt=QUESTION, max_tokens=8)
    assert metric(server, "process_cpu_seconds_total") > before > 0
    assert metric(server, 'python_gc_collections_total{generation="2"}') >= 0


def test_the_wait_for_first_tokens_is_split_within_the_client_s_wait(client, server):
    # One streamed request: each histogram counts it once; the server's time to first
    # tokens lies within the client's, and holds the accept and, in the engine's
    # process, the queue and the prefill (windows inside its own).
    kinds = ("time_to_first_token", "request_accept", "request_queue", "request_prefill")

    def read():
        return {
            k: (
                metric(server, f"ostinato_{k}_seconds_sum"),
                metric(server, f"ostinato_{k}_seconds_count"),
            )
            for k in kinds
        }

    before, start = read(), time.perf_counter()
    stream = client.completions.create(
        model="smollm2-135m", prompt=QUESTION, max_tokens=4, temperature=0, stream=True
    )
    waited = None
    for _ in stream:
        waited = waited if waited is not None else time.perf_counter() - start
    after = read()
    spent = {k: after[k][0] - before[k][0] for k in kinds}
    assert all(after[k][1] - before[k][1] == 1 for k in kinds), (before, after)
    assert waited is not None and 0 < spent["time_to_first_token"] <= waited
    assert spent["time_to_first_token"] >= spent["request_accept"] > 0
    engine = spent["request_queue"] + spent["request_prefill"]
    assert spent["time_to_first_token"] >= engine and spent["request_prefill"] > 0


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(prompt="hi", temperature=-1), "temperature"),
        (dict(prompt=[1, 10**7]), "prompt"),
        (dict(prompt="hi", n=129), "n"),
        (dict(prompt=""), "prompt"),
    ],
)
def test_bad_requests_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="smollm2-135m", max_tokens=4, **kwargs)
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == param, exc.value.body


def test_what_is_not_honoured_is_refused_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=4, best_of=2)
    assert exc.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(
            model="smollm2-135m", prompt="hi", max_tokens=4, extra_body={"top_k": 5}
        )
    assert exc.value.body["param"] == "top_k"
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=4)
    assert exc.value.body["code"] == "model_not_found"


def test_the_token_limit_and_the_usage_of_a_stream(client):
    messages = [{"role": "user", "content": QUESTION}]
    short = client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_completion_tokens=3, temperature=0
    )
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    whole = client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0)
    assert whole.choices[0].finish_reason == "stop"  # no limit given: the room in the context
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_stopped_server_ends_its_streams_after_the_grace_period_and_exits_cleanly():
    gguf_path()
    args = ["--device", "cpu", "--max-model-len", "2048", "--shutdown-timeout", "1", "--quiet"]
    with serving_process(args) as (proc, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model="smollm2-135m",
            prompt="Once upon a time",
            max_tokens=1500,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)  # the stream is running
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        finishes = [c.choices[0].finish_reason for c in chunks]
        assert finishes[-1] == "abort", finishes[-3:]
        code = proc.wait(10)
        took = time.monotonic() - start
        output = proc.stdout.read()
    assert code == 0, output
    assert took < 1 + 2 + 1, took  # the grace period, then 2 s to exit (1 s of slack)
    assert "Traceback" not in output and "leaked semaphore" not in output, output


def test_a_stop_string_ends_the_answer_before_it_whole_and_streamed(client):
    messages = [{"role": "user", "content": QUESTION}]
    ask = dict(model="smollm2-135m", messages=messages, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**ask, stop=["Paris"])
    assert whole.choices[0].finish_reason == "stop"
    text = whole.choices[0].message.content
    assert "Paris" not in text and text.startswith("The capital of France is")
    stream = client.chat.completions.create(**ask, stop=["Paris"], stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream]
    assert "".join(pieces) == text


def test_echo_returns_the_prompt_before_the_completion(client):
    prompt = "The history of the Roman Empire begins with"
    got = client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=6, temperature=0, echo=True
    )
    plain = client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=6, temperature=0
    )
    assert got.choices[0].text == prompt + plain.choices[0].text


def test_n_samples_are_the_offline_engines_whole_and_streamed(client, offline):
    # Three seeded samples of one prompt: three choices, each the offline engine's sample
    # of the same index (the same derived seeds), whole and streamed alike.
    prompt = "Once upon a time, in a land far away,"
    kw = dict(model="smollm2-135m", prompt=prompt, max_tokens=10, temperature=1.0, seed=5, n=3)
    got = client.completions.create(**kw)
    (want,) = offline.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=3)
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [s.text for s in want.samples]
    assert len({c.text for c in got.choices}) > 1
    assert got.usage.completion_tokens == sum(len(s.token_ids) for s in want.samples)
    streamed = ["", "", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [s.text for s in want.samples]


def test_several_prompts_text_parts_and_the_developer_role_through_the_client(client, offline):
    # A list of prompts: one choice per prompt, in order, each the offline answer.
    prompts = ["The history of the Roman Empire begins with", "Water boils at"]
    got = client.completions.create(
        model="smollm2-135m", prompt=prompts, max_tokens=8, temperature=0
    )
    want = offline.generate(prompts, SamplingParams(max_tokens=8))
    assert [(c.index, c.text) for c in got.choices] == [(i, w.text) for i, w in enumerate(want)]
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    # Text parts are the text they join; developer instructions are the system's.
    parts = [
        {"type": "text", "text": "What is the capital"},
        {"type": "text", "text": "of France?"},
    ]
    kw = dict(model="smollm2-135m", max_tokens=12, temperature=0)
    split = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **kw)
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    assert (
        split.choices[0].message.content
        == offline.chat([joined], SamplingParams(max_tokens=12))[0].text
    )
    system = [{"role": "system", "content": "Answer in one word."}, *joined]
    developer = [{"role": "developer", "content": "Answer in one word."}, *joined]
    a = client.chat.completions.create(messages=system, **kw).choices[0].message.content
    b = client.chat.completions.create(messages=developer, **kw).choices[0].message.content
    assert a == b
    stream = client.chat.completions.create(messages=joined, stream=True, **kw)
    assert next(iter(stream)).choices[0].delta.role == "assistant"
