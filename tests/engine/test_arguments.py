"""LLM's grouped arguments and the CPU thread limit (no model is built here)."""

import pytest
import torch

from ostinato.engine import CacheArgs, GraphArgs, ParallelArgs
from ostinato.engine.api.arguments import (
    MAX_CPU_THREADS,
    available_cores,
    group_arguments,
    limit_cpu_threads,
)


def test_plain_keywords_land_in_their_group():
    cache, graphs, parallel = group_arguments(
        None, None, None, {"max_model_len": 64, "mode": "full", "tensor_parallel_size": 2}
    )
    assert cache == CacheArgs(max_model_len=64)
    assert graphs == GraphArgs(mode="full")
    assert parallel == ParallelArgs(tensor_parallel_size=2)


def test_groups_pass_through_and_every_field_has_one_group():
    given = (CacheArgs(block_size=32), GraphArgs(max_capture_size=8), ParallelArgs())
    assert group_arguments(*given, {}) == given
    names = [f for cls in (CacheArgs, GraphArgs, ParallelArgs) for f in cls.__dataclass_fields__]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    "args, keywords, message",
    [
        ((None, None, None), {"max_modle_len": 64}, "unexpected keyword argument 'max_modle_len'"),
        ((CacheArgs(), None, None), {"max_model_len": 64}, "max_model_len: given as a keyword"),
        ((GraphArgs(), None, None), {}, "expected a CacheArgs, got GraphArgs"),
        ((None, {"mode": "full"}, None), {}, "expected a GraphArgs, got dict"),
    ],
)
def test_bad_arguments_are_named(args, keywords, message):
    with pytest.raises(TypeError, match=message):
        group_arguments(*args, keywords)


def test_the_llm_refuses_a_misspelt_keyword_before_loading_anything():
    from ostinato.engine import LLM

    with pytest.raises(TypeError, match="unexpected keyword argument 'mdoe'"):
        LLM("no/such/model", mdoe="full")


def test_cpu_threads_are_limited_unless_the_user_chose(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert limit_cpu_threads(1) is None and torch.get_num_threads() == before
        monkeypatch.delenv("OMP_NUM_THREADS")
        torch.set_num_threads(64)
        cores = available_cores()
        for world in (1, 2, 64):
            got = limit_cpu_threads(world)
            assert got == max(1, min(MAX_CPU_THREADS, cores // world))
            assert torch.get_num_threads() == got
    finally:
        torch.set_num_threads(before)
