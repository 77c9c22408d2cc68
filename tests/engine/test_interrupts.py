"""Ctrl-C at any line: an interrupt injected at the lines the scheduler's and the block
pool's host code runs during a call (a tracing hook raises KeyboardInterrupt there: at
the first run of every line, and at every 25th line run) leaves the engine with nothing
queued, every KV block free, and the next call exact."""

import contextlib
import linecache
import sys
import threading
from pathlib import Path

import pytest

import ostinato.engine.api.engine as engine_module
import ostinato.engine.api.llm as llm_module
import ostinato.engine.core.kv_cache as kv_cache_module
import ostinato.engine.core.request_book as request_book_module
import ostinato.engine.core.scheduler as scheduler_module
from ostinato.engine import LLM, SamplingParams


def _files(*modules) -> set[Path]:
    return {Path(m.__file__).resolve() for m in modules}


FILES = _files(scheduler_module, kv_cache_module)
# The call's own code: the facade, the engine, the request book, and the context
# managers of the standard library it may go through.
CALL_FILES = _files(llm_module, engine_module, request_book_module, contextlib)
IDS = ["a", "b", "c", "d"]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3] * 20, [40, 41, 42]]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


class Lines:
    """A tracing hook over ``FILES``: records each line run, and raises
    KeyboardInterrupt at the ``interrupt_at``-th (1-based) if given."""

    def __init__(self, interrupt_at: int | None = None, files: set[Path] = FILES) -> None:
        self.interrupt_at = interrupt_at
        self.files = files
        self.run: list[tuple[str, int]] = []

    def __call__(self, frame, event, arg):
        return self._line if Path(frame.f_code.co_filename).resolve() in self.files else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.run.append((frame.f_code.co_filename, frame.f_lineno))
            if len(self.run) == self.interrupt_at:
                raise KeyboardInterrupt
        return self._line

    def generate(self, llm, request_ids=None):
        sys.settrace(self)
        try:
            return llm.generate(PROMPTS, PARAMS, request_ids=request_ids)
        finally:
            sys.settrace(None)


def interrupt_points(order: list[tuple[str, int]], every: int = 25) -> list[int]:
    """The first run of every line and every ``every``-th line run, but a bare ``try:``:
    CPython runs a NOP there, where no real interrupt is delivered (and where an
    exception the hook raises escapes the enclosing ``with``'s handler)."""
    first_runs = {}
    for i, key in enumerate(order, start=1):
        first_runs.setdefault(key, i)
    points = set(first_runs.values()) | set(range(every, len(order) + 1, every))
    return sorted(i for i in points if linecache.getline(*order[i - 1]).strip() != "try:")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_interrupt_at_any_line_leaves_the_engine_clean(async_scheduling):
    llm = LLM(
        "tiny",
        device="cpu",
        max_model_len=64,
        max_num_seqs=2,  # requests wait for a seat
        num_blocks=12,  # and for blocks
        progress=False,
        async_scheduling=async_scheduling,
    )
    want = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    recorded = Lines()
    recorded.generate(llm)
    points = interrupt_points(recorded.run)
    assert len(set(recorded.run)) > 50  # the scheduler's and the pool's code ran
    for at in points:
        with pytest.raises(KeyboardInterrupt):
            Lines(at).generate(llm)
        assert not llm.has_work, at
        assert llm.free_kv_blocks == llm.num_kv_blocks - 1, at
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == want, at


def test_an_interrupt_in_the_call_itself_leaves_no_id_and_no_lock_held():
    # Ctrl-C in the facade's, the engine's and the request book's own lines (and the
    # context managers they use): afterwards another thread's call with the same request
    # ids runs (no id left reserved, the engine's lock free) and is exact.
    llm = LLM("tiny", device="cpu", max_model_len=64, max_num_seqs=2, progress=False)
    want = [o.token_ids for o in llm.generate(PROMPTS, PARAMS, request_ids=IDS)]
    recorded = Lines(files=CALL_FILES)
    recorded.generate(llm, IDS)
    points = interrupt_points(recorded.run, every=40)
    assert len(set(recorded.run)) > 30
    for at in points:
        with pytest.raises(KeyboardInterrupt):
            Lines(at, CALL_FILES).generate(llm, IDS)
        got: dict = {}

        def again(got=got):
            got["tokens"] = [o.token_ids for o in llm.generate(PROMPTS, PARAMS, request_ids=IDS)]

        other = threading.Thread(target=again, daemon=True)
        other.start()
        other.join(60)
        assert not other.is_alive(), f"another thread's call waits for a lock left held ({at})"
        assert got.get("tokens") == want, at


def test_abort_of_a_request_that_finished_while_its_call_runs_is_false():
    llm = LLM("tiny", device="cpu", max_model_len=64, max_num_seqs=4, progress=False)
    long_tokens, asked = [], {}

    def on_token(i, token):
        if i == 0:
            long_tokens.append(token)
            if len(long_tokens) == 8:  # "short" ended at its 2 tokens, long before
                asked["short"] = llm.abort("short")
                asked["long"] = llm.abort("long")

    params = [SamplingParams(max_tokens=20, ignore_eos=True), SamplingParams(max_tokens=2)]
    outs = llm.generate(
        [[5, 6, 7], [8, 9]], params, on_token=on_token, request_ids=["long", "short"]
    )
    assert asked == {"short": False, "long": True}  # finished: nothing to abort; running: yes
    assert outs[1].finish_reason.value in ("length", "stop")
    assert outs[0].finish_reason.value == "abort"
