"""The engine in a child process (what `ostinato serve` runs): threads and asyncio tasks
submitting, streaming and aborting get their solo tokens; refusals name the field in the
caller's thread; a child that fails to start, or dies, says so."""

import asyncio
import multiprocessing
import os
import signal
import sys
import threading
import time

import pytest

from ostinato.engine import LLM, SamplingParams
from ostinato.engine.core.scheduler import FinishReason
from ostinato.engine.serve.engine_process import SWITCH_INTERVAL_S, EngineDead, EngineProcess

KWARGS = dict(model="tiny", device="cpu", max_model_len=96, max_num_seqs=4, progress=False)
PROMPTS = [[1 + i, 7, 3 * i + 2, 9] for i in range(8)]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def solo():
    llm = LLM(**KWARGS)
    return [llm.generate([p], PARAMS)[0].token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def engine():
    engine = EngineProcess(KWARGS, describe=False)
    yield engine
    assert engine.stop(), f"the engine process exited with code {engine._proc.exitcode}"


def test_threads_and_tasks_get_their_solo_tokens(engine, solo):
    got = {}

    def client(i):
        handle = engine.submit(PROMPTS[i], PARAMS)
        got[i] = list(handle)

    async def tasks():
        async def one(i):
            handle = await engine.asubmit(PROMPTS[i], PARAMS)
            got[i] = [t async for t in handle]

        await asyncio.gather(*(one(i) for i in range(4, 8)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    asyncio.run(tasks())
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(8)] == solo
    status = engine.status()
    assert status.free_kv_blocks == status.kv_blocks - 1 and status.running == 0


def test_abort_ends_a_request_early(engine, solo):
    handle = engine.submit(PROMPTS[0], SamplingParams(max_tokens=80, ignore_eos=True))
    tokens = []
    for token in handle:
        tokens.append(token)
        if len(tokens) == 2:
            engine.abort(handle.id)
    assert handle.finish_reason is FinishReason.ABORT and len(tokens) < 80
    assert tokens[:2] == solo[0][:2]


def test_refusals_name_the_field_in_the_callers_thread(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([1, 10**6])

    async def refused():
        with pytest.raises(ValueError, match="empty"):
            await engine.asubmit([])

    asyncio.run(refused())
    assert engine.status().running == 0


def test_an_engine_that_cannot_start_says_why():
    with pytest.raises(EngineDead, match="max_model_len"):
        EngineProcess({**KWARGS, "max_model_len": -5}, describe=False)


def test_a_dead_engine_ends_open_requests_and_refuses_new_ones():
    engine = EngineProcess({**KWARGS, "max_model_len": 1024}, describe=False)
    handle = engine.submit([1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))
    os.kill(engine._proc.pid, signal.SIGKILL)
    with pytest.raises(EngineDead, match="exited"):
        list(handle)
    with pytest.raises(EngineDead):
        engine.submit([1, 2, 3])
    engine.stop()


def test_threads_waiting_for_the_child_together_all_see_its_exit_code():
    # The reader thread (pipe closed) and stop() wait for the child at the same moment; a
    # loser of two concurrent waitpid calls used to read the exit code as None.
    process = EngineProcess.__new__(EngineProcess)
    process._reap_lock = threading.Lock()
    process._proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0.5,))
    process._proc.start()
    codes = []
    waiters = [threading.Thread(target=lambda: codes.append(process._reap(30))) for _ in range(8)]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join(60)
    assert codes == [0] * 8


def test_events_wait_for_no_slow_reader_and_arrive_in_order():
    # A parent that reads late (a send blocked until released): the engine's loop still
    # hands every step's events over at once; they then travel merged, in order, and
    # close() sends what is left.
    from ostinato.engine.serve.engine_process import _Outbox, _unwire
    from ostinato.engine.serve.loop import TokenEvent

    sent, release = [], threading.Event()

    def slow_send(message):
        release.wait(10)
        sent.append(message)

    outbox = _Outbox(slow_send)
    start = time.perf_counter()
    for step in range(50):
        outbox.put([TokenEvent("a", [step]), TokenEvent("b", [100 + step])])
    assert time.perf_counter() - start < 1.0 and not sent  # nobody waited on the reader
    release.set()
    outbox.close()
    events = [e for kind, batch in sent for e in _unwire(batch) if kind == "events"]
    assert [e.tokens[0] for e in events if e.request_id == "a"] == list(range(50))
    assert [e.tokens[0] for e in events if e.request_id == "b"] == list(range(100, 150))
    assert len(sent) < 50  # merged while the reader was slow


def test_events_stop_quietly_once_the_parent_is_gone():
    from ostinato.engine.serve.engine_process import _Outbox
    from ostinato.engine.serve.loop import TokenEvent

    def gone(message):
        raise BrokenPipeError

    outbox = _Outbox(gone)
    outbox.put([TokenEvent("a", [1])])
    outbox.close(timeout=5)
    assert not outbox._thread.is_alive()


def test_events_cross_the_pipe_whole_as_plain_tuples():
    import pickle

    from ostinato.engine.core.scheduler import FinishReason
    from ostinato.engine.serve.engine_process import _unwire, _wire
    from ostinato.engine.serve.loop import EngineTiming, TokenEvent

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    events = [
        TokenEvent("a", [1, 2], timing=EngineTiming(0.25, 0.5)),
        TokenEvent("b", [3], True, FinishReason.LENGTH, logprobs=[("x", -0.5)]),
        TokenEvent("c", [], True, None, Unpicklable("the step failed")),
    ]
    rows = pickle.loads(pickle.dumps(_wire(events)))
    assert all(type(row) is tuple for row in rows)  # nothing of the engine's types
    assert all(type(row[-1]) in (tuple, type(None)) for row in rows)
    back = _unwire(rows)
    assert [(e.request_id, e.tokens, e.ended, e.finish, e.logprobs, e.timing) for e in back] == [
        ("a", [1, 2], False, None, None, EngineTiming(0.25, 0.5)),
        ("b", [3], True, FinishReason.LENGTH, [("x", -0.5)], None),
        ("c", [], True, None, None, None),
    ]
    assert back[0].error is None and back[1].error is None
    assert isinstance(back[2].error, RuntimeError) and str(back[2].error) == "the step failed"


def test_a_begun_engine_is_served_once_ready_or_abandoned():
    before = sys.getswitchinterval()
    begun = EngineProcess.begin(KWARGS, describe=False)
    assert begun.ready() is begun
    # the reader thread gets the interpreter lock promptly while it serves, and the
    # interval is back as it was once it stops (other engines of the module may be running)
    assert sys.getswitchinterval() == min(before, SWITCH_INTERVAL_S)
    assert list(begun.submit([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert begun.stop()
    assert sys.getswitchinterval() == before
    left = EngineProcess.begin(KWARGS, describe=False)  # abandoned while it builds
    left.abandon()
    assert not left._proc.is_alive() and left._proc.exitcode is not None
