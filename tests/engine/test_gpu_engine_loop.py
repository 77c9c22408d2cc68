"""The engine loop on the GPU (graphs, asynchronous scheduling): threads and asyncio tasks
submitting, streaming and aborting; each result equals its solo greedy output, every KV
block is free afterwards, and the graph statistics count the steps."""

import asyncio
import random
import threading

import pytest
import torch
from gpu_harness import tiny_engine

from ostinato.engine import SamplingParams
from ostinato.engine.core.scheduler import FinishReason
from ostinato.engine.serve.loop import EngineLoop

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def llm():
    # float32: a request's greedy tokens must not depend on its batch's other rows, and
    # bf16 rounding can flip a near-tie when the batch (so the GEMM's tiling) changes.
    return tiny_engine("auto", torch.float32, max_num_seqs=16)


def workload(n, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(2, 60))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in range(n)]
    return prompts, params


def test_threads_and_tasks_get_their_solo_tokens_on_graphs(llm):
    prompts, params = workload(24, seed=5)
    # Solo, one request per call: the reference each concurrent result must equal.
    want = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    before = llm.graph_stats()
    loop = EngineLoop(llm)
    got: dict[int, tuple[list[int], FinishReason | None]] = {}

    def client(i):
        handle = loop.submit(prompts[i], params[i])
        tokens = []
        for token in handle:
            tokens.append(token)
            if i % 7 == 3 and len(tokens) == 2:
                loop.abort(handle.id)
        got[i] = (tokens, handle.finish_reason)

    async def tasks():
        async def one(i):
            handle = await loop.asubmit(prompts[i], params[i])
            got[i] = ([t async for t in handle], handle.finish_reason)

        await asyncio.gather(*(one(i) for i in range(12, 24)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    asyncio.run(tasks())
    for t in threads:
        t.join(120)
    assert loop.stop()
    for i, (tokens, reason) in got.items():
        if reason is FinishReason.ABORT:
            assert i % 7 == 3 and tokens == want[i][: len(tokens)], i
        else:
            assert tokens == want[i], i
    assert len(got) == 24
    assert llm.free_kv_blocks == llm.num_kv_blocks - 1
    stats = llm.graph_stats()
    assert stats.replays > before.replays  # decode steps replayed their graphs
    assert 0 <= stats.padding_fraction < 1
