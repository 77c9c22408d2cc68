"""LLM.generate is all or nothing: every bad call raises before queuing anything, an
interrupted call leaves nothing behind, and a good call afterwards just works."""

import pytest

from ostinato.engine import LLM, FinishReason, SamplingParams
from ostinato.engine.model.presets import shape


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", max_model_len=64, max_num_seqs=4, progress=False)


def assert_clean_and_working(llm):
    assert not llm.has_work
    assert llm.free_kv_blocks == llm.num_kv_blocks - 1
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out.token_ids) == 2


BAD_CALLS = [
    (([[1, 2]], {"max_tokens": 3}), TypeError, "params: expected SamplingParams"),
    (([[1, 2]], [None]), TypeError, r"params\[0\]: expected SamplingParams"),
    (([[1, 2], [3]], [SamplingParams()]), ValueError, "params: 1 given for 2 prompts"),
    (([1, 2, 3],), TypeError, "flat list of ints; wrap"),
    (("hello",), TypeError, "expected a list of prompts"),
    (([[1, 2.5]],), TypeError, "prompt 0: token 1 is 2.5, not an int"),
    (([[1, "2"]],), TypeError, "prompt 0: token 1 is '2', not an int"),
    (([[1], [True]],), TypeError, "prompt 1: token 0 is True, not an int"),
    (([[1], 7],), TypeError, "prompt 1: expected a list of token ids"),
    (([[1], [-1]],), ValueError, r"prompt 1: token ids \[-1\] outside the vocabulary"),
    (([[1], [1] * 64],), ValueError, "prompt 1: 64 tokens leave no room"),
    (([[1], []],), ValueError, "prompt 1: empty"),
]


@pytest.mark.parametrize("args, error, message", BAD_CALLS, ids=[b[2][:30] for b in BAD_CALLS])
def test_bad_call_raises_queues_nothing_and_engine_still_works(llm, args, error, message):
    with pytest.raises(error, match=message):
        llm.generate(*args)
    assert_clean_and_working(llm)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": 2}, "top_p"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_sampling_params_refuse_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_interrupted_generate_leaves_nothing_queued(llm):
    def interrupt(index, token):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(
            [[1, 2, 3], [4, 5]], SamplingParams(max_tokens=40, ignore_eos=True), on_token=interrupt
        )
    assert_clean_and_working(llm)


def test_exception_in_the_middle_of_a_step_aborts_the_call(llm, monkeypatch):
    calls = []

    def failing(step, *rest):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device fell over")
        return real(step, *rest)

    real = llm.engine.runner.execute
    monkeypatch.setattr(llm.engine.runner, "execute", failing)
    with pytest.raises(RuntimeError, match="fell over"):
        llm.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=10, ignore_eos=True))
    monkeypatch.setattr(llm.engine.runner, "execute", real)
    assert_clean_and_working(llm)


def test_finish_reasons_name_the_limit(llm):
    free = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert free.finish_reason is FinishReason.LENGTH
    stop = free.token_ids[2]
    stopped = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))[0]
    assert stopped.finish_reason is FinishReason.STOP and stopped.token_ids[-1] == stop
    with pytest.raises(ValueError, match="stop_token_ids: token id 100000 outside"):
        llm.generate([[1, 2, 3]], SamplingParams(stop_token_ids=(stop, 100000)))
    long = llm.generate([[1] * 60], SamplingParams(max_tokens=5000, ignore_eos=True))[0]
    assert long.finish_reason is FinishReason.MAX_MODEL_LEN and len(long.token_ids) == 4


def test_on_token_streams_every_token_in_order(llm):
    seen = {0: [], 1: []}
    outs = llm.generate(
        [[1, 2], [3, 4, 5]],
        SamplingParams(max_tokens=5, ignore_eos=True),
        on_token=lambda i, t: seen[i].append(t),
    )
    assert [seen[0], seen[1]] == [o.token_ids for o in outs]


def test_max_model_len_beyond_the_models_positions():
    with pytest.raises(ValueError, match="max_model_len: 4096 exceeds the 2048 positions"):
        LLM("tiny", device="cpu", max_model_len=4096, progress=False)
    scaled = {
        **shape("tiny"),
        "max_position_embeddings": 1024,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    }
    llm = LLM(scaled, device="cpu", max_model_len=4096, max_num_seqs=1, progress=False)
    assert llm.engine.scheduler.max_model_len == 4096


def test_num_blocks_too_small_for_one_sequence():
    with pytest.raises(ValueError, match="num_blocks: 3 blocks .* cannot hold one sequence"):
        LLM("tiny", device="cpu", max_model_len=64, num_blocks=3, progress=False)


def test_a_temperature_too_small_to_divide_by_is_greedy(llm):
    tiny = SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True)
    assert tiny.temperature == 0.0 and tiny.greedy
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    assert (
        llm.generate([[5, 6, 7]], tiny)[0].token_ids
        == llm.generate([[5, 6, 7]], greedy)[0].token_ids
    )


def test_text_that_is_not_valid_unicode_names_its_prompt():
    from ostinato.engine.api.prompts import check_prompts

    class Letters:
        def encode(self, text):
            return [ord(c) % 100 for c in text]

    with pytest.raises(ValueError, match=r"prompt 1: text that is not valid Unicode"):
        check_prompts(["fine", "bad \udc80 byte"], Letters(), 100, lambda tokens: None)


def test_generate_from_several_threads_gives_each_its_solo_tokens(llm):
    import threading

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[i + 1, 2 * i + 3, 7] for i in range(6)]
    solo = [llm.generate([p], params)[0].token_ids for p in prompts]
    got: dict[int, list[int]] = {}

    def call(i: int) -> None:
        got[i] = llm.generate([prompts[i]], params)[0].token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(len(prompts))] == solo
    assert_clean_and_working(llm)


def test_generate_inside_its_own_callback_is_refused(llm):
    def again(index, token):
        llm.generate([[1, 2]], SamplingParams(max_tokens=1))

    with pytest.raises(RuntimeError, match="inside its own on_token callback"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), on_token=again)
    assert_clean_and_working(llm)


def test_a_closed_engine_says_it_is_closed():
    closed = LLM("tiny", device="cpu", max_model_len=32, max_num_seqs=2, progress=False)
    closed.close()
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        closed.generate([[1, 2]])


def test_abort_by_request_id_from_the_callback_and_from_another_thread(llm):
    import threading

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    solo = [llm.generate([p], params)[0].token_ids for p in prompts]

    def stop_first(index, token):
        if index == 0:
            assert llm.abort("first")

    outs = llm.generate(prompts, params, on_token=stop_first, request_ids=["first", "second"])
    assert [o.request_id for o in outs] == ["first", "second"]
    assert outs[0].finish_reason is FinishReason.ABORT
    assert outs[0].token_ids == solo[0][: len(outs[0].token_ids)]
    assert outs[1].token_ids == solo[1] and outs[1].finish_reason is FinishReason.LENGTH

    started = threading.Event()
    aborter = threading.Thread(target=lambda: started.wait(30) and llm.abort("slow"))
    aborter.start()
    slow = SamplingParams(max_tokens=80, ignore_eos=True)
    (out,) = llm.generate([[8, 9]], slow, request_ids=["slow"], on_token=lambda i, t: started.set())
    aborter.join()
    assert out.finish_reason is FinishReason.ABORT and len(out.token_ids) < 80
    assert not llm.abort("slow")  # finished: nothing to abort
    assert llm.free_kv_blocks == llm.num_kv_blocks - 1


@pytest.mark.parametrize(
    "ids, error, message",
    [
        (["a", "a"], ValueError, "'a' is given twice"),
        (["a"], ValueError, "expected a sequence of 2 ids"),
        ("ab", ValueError, "expected a sequence of 2 ids"),
        ([1, "b"], TypeError, "must be a non-empty string"),
    ],
)
def test_bad_request_ids_are_named_before_anything_runs(llm, ids, error, message):
    with pytest.raises(error, match=message):
        llm.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=2), request_ids=ids)
    assert not llm.has_work and llm.free_kv_blocks == llm.num_kv_blocks - 1
    outs = llm.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=2))
    assert all(o.request_id.startswith("generate-") for o in outs)
