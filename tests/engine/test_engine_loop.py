"""One engine loop, many callers: threads and asyncio tasks submitting, streaming and
aborting against one engine; each result equals its solo greedy output, every block is
free afterwards."""

import asyncio
import random
import threading
import time

import pytest

from ostinato.engine import LLM, SamplingParams
from ostinato.engine.core.scheduler import FinishReason
from ostinato.engine.serve.loop import EngineLoop, RequestHandle, _Post


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", max_model_len=96, max_num_seqs=4, progress=False)


def workload(n, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(2, 24))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in range(n)]
    return prompts, params


def solo(llm, prompts, params):
    return [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]


def test_threads_streaming_and_aborting_get_their_solo_tokens(llm):
    prompts, params = workload(16, seed=1)
    want = solo(llm, prompts, params)
    loop = EngineLoop(llm)
    got, aborted = {}, set()

    def client(i):
        handle = loop.submit(prompts[i], params[i])
        tokens = []
        for token in handle:
            tokens.append(token)
            if i % 5 == 0 and len(tokens) == 2:
                loop.abort(handle.id)
                aborted.add(i)
        got[i] = (tokens, handle.finish_reason)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert loop.stop()
    for i, (tokens, reason) in got.items():
        if i in aborted and reason is FinishReason.ABORT:
            assert tokens == want[i][: len(tokens)]  # a prefix, then it stopped
        else:
            assert tokens == want[i] and reason is FinishReason.LENGTH, i
    assert loop.stats.aborted >= 1
    assert not llm.has_work and llm.free_kv_blocks == llm.num_kv_blocks - 1


def test_asyncio_tasks_get_their_solo_tokens(llm):
    prompts, params = workload(12, seed=2)
    want = solo(llm, prompts, params)
    loop = EngineLoop(llm)

    async def client(i):
        handle = await loop.asubmit(prompts[i], params[i])
        tokens = []
        async for token in handle:
            tokens.append(token)
            if i % 4 == 1 and len(tokens) == 1:
                assert loop.abort(handle.id)
        return tokens, handle.finish_reason

    async def everyone():
        return await asyncio.gather(*(client(i) for i in range(len(prompts))))

    for i, (tokens, reason) in enumerate(asyncio.run(everyone())):
        if reason is FinishReason.ABORT:
            assert i % 4 == 1 and tokens == want[i][: len(tokens)]
        else:
            assert tokens == want[i], i
    assert loop.stop()
    assert llm.free_kv_blocks == llm.num_kv_blocks - 1


def test_an_abort_before_admission_runs_nothing(llm):
    loop = EngineLoop(llm)
    # Fill every seat, then queue one more and abort it while it waits.
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    busy = [loop.submit([1 + i, 2, 3], params) for i in range(4)]
    late = loop.submit([9, 9, 9], params)
    assert loop.abort(late.id)
    assert list(late) == [] and late.finish_reason is FinishReason.ABORT
    assert all(len(list(h)) == 30 for h in busy)
    assert not loop.abort(late.id) and not loop.abort("no-such-request")
    assert loop.stop()
    assert llm.free_kv_blocks == llm.num_kv_blocks - 1


def test_bad_requests_are_refused_in_the_callers_thread(llm):
    loop = EngineLoop(llm)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        loop.submit([1, 10**6])
    with pytest.raises(ValueError, match="empty"):
        loop.submit([])
    assert loop.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        loop.submit([1, 2])


def test_a_failing_step_ends_its_requests_and_the_loop_serves_on(llm, monkeypatch):
    loop = EngineLoop(llm)
    real_launch = llm.engine.loop.launch
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device said no")
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(llm.engine.loop, "launch", flaky)
    doomed = loop.submit([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    with pytest.raises(RuntimeError, match="device said no"):
        list(doomed)
    fine = loop.submit([4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(list(fine)) == 3
    assert loop.stop()
    assert llm.free_kv_blocks == llm.num_kv_blocks - 1


def test_generate_waits_while_a_loop_serves(llm):
    loop = EngineLoop(llm)
    done = threading.Event()

    def call():
        llm.generate([[1, 2]], SamplingParams(max_tokens=1))
        done.set()

    threading.Thread(target=call).start()
    assert not done.wait(0.3)
    assert loop.stop()
    assert done.wait(30)


def test_samples_stream_on_handles_of_their_own_and_an_abort_ends_them_all(llm, monkeypatch):
    # n = 3 seeded samples: the handle is the first sample's, ``others`` the rest; each
    # streams LLM.generate's sample of the same index. Aborting the id after the first
    # tokens ends every sample, and every block comes back. (For the abort each step
    # waits until the test has asked it, so no busy machine lets the samples finish.)
    prompt = list(range(40, 80))
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=4, n=3)
    (want,) = llm.generate([prompt], params)
    loop = EngineLoop(llm)
    handle = loop.submit(prompt, params)
    assert [h.id for h in handle.samples] == [handle.id, f"{handle.id}#1", f"{handle.id}#2"]
    assert [list(h) for h in handle.samples] == [s.token_ids for s in want.samples]
    assert all(h.finish_reason is FinishReason.LENGTH for h in handle.samples)
    assert loop.stop()
    asked, steps = threading.Event(), llm.engine.steps

    def waiting_steps():
        for i, step in enumerate(steps()):
            yield step
            if i:  # (asynchronous scheduling resolves the first tokens a step later)
                asked.wait(60)

    monkeypatch.setattr(llm.engine, "steps", waiting_steps)
    loop = EngineLoop(llm)
    long = loop.submit(prompt[:10], SamplingParams(max_tokens=80, ignore_eos=True, n=3))
    first = next(iter(long))
    assert loop.abort(long.id)
    asked.set()
    rest = [first, *long]
    assert len(rest) < 80 and all(h.finish_reason is FinishReason.ABORT for h in long.samples)
    assert all(len(list(h)) < 80 for h in long.others)
    assert loop.stop()
    assert not llm.has_work and llm.free_kv_blocks == llm.num_kv_blocks - 1


def test_every_sample_of_a_request_aborted_before_admission_ends(llm, monkeypatch):
    # An abort that lands before the loop queues the request (every one, here) ends the
    # handles of all its samples, with no tokens: none is left waiting for ever.
    from ostinato.engine.api.engine import Session

    monkeypatch.setattr(Session, "aborted_early", lambda self, request_id: True)
    loop = EngineLoop(llm)
    handle = loop.submit([1, 2, 3], SamplingParams(max_tokens=4, n=3))
    got = []
    reader = threading.Thread(
        target=lambda: got.extend(list(h) for h in handle.samples), daemon=True
    )
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "a sample's handle never ended"
    assert got == [[], [], []]
    assert all(h.finish_reason is FinishReason.ABORT for h in handle.samples)
    assert loop.stop()
    assert llm.free_kv_blocks == llm.num_kv_blocks - 1


def test_each_sample_times_its_wait_for_its_first_tokens_and_nothing_is_kept(llm, monkeypatch):
    # Eight sequences (one request of three samples) on four seats, and one more aborted
    # while it waits for a seat: the first event with a sample's tokens, and no other, says how
    # long the engine kept it (accepted -> admitted -> first tokens), within the wall
    # time from before its ``enqueue`` to the event's arrival; the samples of one request
    # share its admission; nothing is kept per request once every one has ended. (The
    # steps wait until every request is queued, and after the second until the last one
    # is aborted: it is admitted, and still without a seat, whatever the machine's load.)
    seen, ended, done = [], set(), threading.Event()
    queued, aborted, steps = threading.Event(), threading.Event(), llm.engine.steps
    ids = {f"r{i}" for i in range(5)} | {"s", "s#1", "s#2", "late"}

    def held_steps():
        queued.wait(60)
        for i, step in enumerate(steps()):
            yield step
            if i == 1:
                aborted.wait(60)

    def publish(events):
        now = time.perf_counter()
        seen.extend((now, e) for e in events)
        ended.update(e.request_id for e in events if e.ended)
        if ended >= ids:
            done.set()

    monkeypatch.setattr(llm.engine, "steps", held_steps)
    loop = EngineLoop(llm, publish=publish)
    asked = {}
    for i in range(5):
        asked[f"r{i}"] = time.perf_counter()
        loop.enqueue(f"r{i}", [1 + i, 2, 3, 4], SamplingParams(max_tokens=12, ignore_eos=True))
    asked["s"] = time.perf_counter()
    three = SamplingParams(max_tokens=6, ignore_eos=True, n=3, temperature=1.0, seed=1)
    loop.enqueue("s", [5, 6, 7], three)
    loop.enqueue("late", [8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
    queued.set()
    deadline = time.monotonic() + 60
    while "late" not in loop._since and time.monotonic() < deadline:
        time.sleep(0.001)  # (admitted at the step boundary after the first step)
    assert "late" in loop._since and not any(e.request_id == "late" for _, e in seen)
    loop.abort("late")
    aborted.set()
    assert done.wait(120), f"never ended: {ids - ended}"
    assert loop._since == {}
    assert loop.stop()
    timings = {}
    for rid in ids - {"late"}:
        events = [(t, e) for t, e in seen if e.request_id == rid]
        first = next(i for i, (_, e) in enumerate(events) if e.tokens)
        assert all(e.timing is None for i, (_, e) in enumerate(events) if i != first), rid
        arrived, timing = events[first][0], events[first][1].timing
        assert timing is not None and timing.queued >= 0 and timing.prefill > 0, rid
        assert timing.queued + timing.prefill <= arrived - asked[rid.split("#")[0]], rid
        timings[rid] = timing
    assert timings["s"].queued == timings["s#1"].queued == timings["s#2"].queued
    assert all(e.timing is None for _, e in seen if e.request_id == "late")
    assert not llm.has_work and llm.free_kv_blocks == llm.num_kv_blocks - 1


def test_an_async_handle_groups_what_arrived_and_survives_a_cancelled_reader():
    async def run():
        aloop = asyncio.get_running_loop()
        handle = RequestHandle("req-0", [1], aloop)
        chunks = handle.chunks()
        waiting = asyncio.ensure_future(chunks.__anext__())
        await asyncio.sleep(0)
        waiting.cancel()  # a reader that gave up while nothing had come
        with pytest.raises(asyncio.CancelledError):
            await waiting
        for step in ([1, 2], [3]):  # two steps' posts before the next reader runs
            post = _Post()
            handle._put(step, post)
            post.send()
        post = _Post()
        handle._put([4], post)
        handle._end(FinishReason.LENGTH, None, post)
        post.send()
        await asyncio.sleep(0)
        got = [chunk async for chunk in handle.chunks()]
        failed = RequestHandle("req-1", [1], aloop)
        failed._put([5])
        failed._end(None, RuntimeError("step failed"))
        with pytest.raises(RuntimeError, match="step failed"):
            [chunk async for chunk in failed.chunks()]
        return got

    # every token that came before the end, in one chunk; the end stops the stream
    assert asyncio.run(run()) == [[1, 2, 3, 4]]
