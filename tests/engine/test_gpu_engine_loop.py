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
    return tiny_engine("auto", torch.float32, max_num_seqs=16, gpu_memory_utilization=0.3)


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


def test_the_engine_in_a_child_process_gives_the_same_tokens(llm):
    from ostinato.engine.serve.engine_process import EngineProcess

    prompts, params = workload(8, seed=6)
    want = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    kwargs = dict(model="tiny", mode="auto", dtype=torch.float32, seed=3, max_model_len=256)
    kwargs.update(max_num_seqs=16, progress=False, gpu_memory_utilization=0.3)
    engine = EngineProcess(kwargs, describe=False)  # beside the fixture's engine: 0.3 each
    try:
        handles = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
        assert [list(h) for h in handles] == want
        status = engine.status()
        assert status.free_kv_blocks == status.kv_blocks - 1
        assert status.graph_stats.replays > 0
    finally:
        assert engine.stop()
