"""`ostinato serve` as a real process on 127.0.0.1 with SmolLM2-135M-Instruct on the CPU,
talked to with the official `openai` client: completions, chat, streaming, an abort by
disconnect, bad requests, health and metrics; then stopped."""

import pytest
from smollm2 import gguf_path

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serve_harness import all_blocks_free, metric, served, wait_for_abort  # noqa: E402

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


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(prompt="hi", temperature=-1), "temperature"),
        (dict(prompt=[1, 10**7]), "prompt"),
        (dict(prompt="hi", n=2), "n"),
        (dict(prompt=""), "prompt"),
    ],
)
def test_bad_requests_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="smollm2-135m", max_tokens=4, **kwargs)
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == param, exc.value.body
