"""`ostinato serve` on the GPU (SmolLM2-135M-Instruct, graphs, asynchronous scheduling)
as a real process, talked to with the official `openai` client from many threads at once:
each streamed answer equals its prompt's solo greedy answer offline, chat included; steps
run from graphs; a client that hangs up mid-stream aborts its request; afterwards every
KV block is free."""

import threading

import pytest
import torch
from smollm2 import gguf_path

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
openai = pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serve_harness import (  # noqa: E402
    all_blocks_free,
    graphs_ready,
    metric,
    metric_sum,
    served,
    wait_for_abort,
)

from ostinato.engine import LLM, SamplingParams  # noqa: E402

MODEL = "smollm2-135m"
ARGS = ["--device", "cuda", "--max-model-len", "512", "--max-num-seqs", "8", "--quiet"]
ARGS += ["--gpu-memory-utilization", "0.3"]
PROMPTS = [
    "The history of the Roman Empire begins with",
    "Photosynthesis is the process by which plants",
    "A recipe for bread needs flour, water,",
    "The three laws of motion were written by",
    "In the year 1969, astronauts landed on",
    "def fibonacci(n):\n    ",
    "The largest ocean on Earth is",
    "To learn a new language quickly, you should",
    "Once upon a time, in a small village by the sea,",
    "The capital of Japan is",
    "Water boils at a temperature of",
    "My favourite book is",
]
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def server():
    gguf_path()
    with served(ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def offline():
    # GGUF weights run float32 on CUDA: a request's greedy answer does not hang on the
    # rows batched with it, so the server's answers must equal these solo ones.
    llm = LLM(device="cuda", max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.3)
    assert llm.wait_for_graphs(120)  # (the default captures in the background)
    params = SamplingParams(max_tokens=32)
    texts = [llm.generate([p], params)[0].text for p in PROMPTS]
    chat = llm.chat([CHAT], SamplingParams(max_tokens=24))[0].text
    llm.close()
    return texts, chat


def stream_text(client, prompt):
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stream=True
    )
    return "".join(c.choices[0].text for c in stream)


def test_concurrent_streams_equal_solo_greedy_on_graphs(server, offline):
    texts, chat_text = offline
    assert graphs_ready(server)  # the default server captures in the background
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    replays = metric_sum(server, "ostinato_graph_replays_total")
    got: dict[int, str] = {}

    def one(i):
        got[i] = stream_text(client, PROMPTS[i])

    def chat():
        reply = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True
        )
        got[-1] = "".join(c.choices[0].delta.content or "" for c in reply)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    threads.append(threading.Thread(target=chat))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(PROMPTS))] == texts
    assert got.get(-1) == chat_text
    assert metric_sum(server, "ostinato_graph_replays_total") > replays + 20
    assert all_blocks_free(server)


def test_a_client_that_hangs_up_aborts_and_frees_its_blocks(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    before = metric(server, "ostinato_aborted_requests_total")
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=0, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_for_abort(server, before)
    assert all_blocks_free(server)
