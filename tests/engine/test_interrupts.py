"""Ctrl-C at any line: an interrupt injected at the lines the scheduler's and the block
pool's host code runs during a call (a tracing hook raises KeyboardInterrupt there: at
the first run of every line, and at every 25th line run) leaves the engine with nothing
queued, every KV block free, and the next call exact."""

import sys
from pathlib import Path

import pytest

import ostinato.engine.core.kv_cache as kv_cache_module
import ostinato.engine.core.scheduler as scheduler_module
from ostinato.engine import LLM, SamplingParams

FILES = {Path(scheduler_module.__file__).resolve(), Path(kv_cache_module.__file__).resolve()}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3] * 20, [40, 41, 42]]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


class Lines:
    """A tracing hook over ``FILES``: records each line run, and raises
    KeyboardInterrupt at the ``interrupt_at``-th (1-based) if given."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        self.interrupt_at = interrupt_at
        self.run: list[tuple[str, int]] = []

    def __call__(self, frame, event, arg):
        return self._line if Path(frame.f_code.co_filename).resolve() in FILES else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.run.append((frame.f_code.co_filename, frame.f_lineno))
            if len(self.run) == self.interrupt_at:
                raise KeyboardInterrupt
        return self._line

    def generate(self, llm):
        sys.settrace(self)
        try:
            return llm.generate(PROMPTS, PARAMS)
        finally:
            sys.settrace(None)


def interrupt_points(order: list[tuple[str, int]], every: int = 25) -> list[int]:
    first_runs = {}
    for i, key in enumerate(order, start=1):
        first_runs.setdefault(key, i)
    return sorted(set(first_runs.values()) | set(range(every, len(order) + 1, every)))


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
