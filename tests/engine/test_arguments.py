"""LLM's grouped arguments and the CPU thread limit (no model is built here)."""

import pytest
import torch

from ostinato.engine import CacheArgs, EngineArgs, GraphArgs, KernelOptions, ParallelArgs
from ostinato.engine.api.arguments import MAX_CPU_THREADS, available_cores, limit_cpu_threads
from ostinato.engine.api.engine_args import cli_fields


def test_plain_keywords_land_in_their_group():
    args = EngineArgs.build(
        "tiny", max_model_len=64, mode="full", tensor_parallel_size=2, pdl=False, seed=3
    )
    assert args.model == "tiny" and args.seed == 3
    assert args.cache == CacheArgs(max_model_len=64)
    assert args.graphs == GraphArgs(mode="full")
    assert args.parallel == ParallelArgs(tensor_parallel_size=2)
    assert args.kernels == KernelOptions(pdl=False)


def test_groups_pass_through_and_every_field_has_one_home():
    given = dict(cache=CacheArgs(block_size=32), graphs=GraphArgs(max_capture_size=8))
    args = EngineArgs.build(**given)
    assert (args.cache, args.graphs) == (given["cache"], given["graphs"])
    names = [f.name for f in cli_fields()]
    assert len(names) == len(set(names)), "a flag per field, each field once"


def test_every_bool_field_is_a_switch_on_the_command_line():
    # A bool field, or a bool-or-None one (None: left unset) marked ``switch``, is a
    # --name/--no-name flag; unmarked, a bool-or-None field would take a string.
    import argparse

    from ostinato.engine.api.engine_args import add_cli_options

    parser = argparse.ArgumentParser()
    add_cli_options(parser)
    switches = {a.dest for a in parser._actions if isinstance(a, argparse.BooleanOptionalAction)}
    booleans = {f.name for f in cli_fields() if str(f.type).startswith("bool")}
    assert {"pdl", "small_gemm", "compile_ahead", "fused_layers"} <= booleans
    assert booleans <= switches, booleans - switches


@pytest.mark.parametrize(
    "given, message",
    [
        ({"max_modle_len": 64}, "unexpected keyword argument 'max_modle_len'"),
        ({"cache": CacheArgs(), "max_model_len": 64}, "max_model_len: given as a keyword"),
        ({"cache": GraphArgs()}, "cache: expected a CacheArgs, got GraphArgs"),
        ({"graphs": {"mode": "full"}}, "graphs: expected a GraphArgs, got dict"),
    ],
)
def test_bad_arguments_are_named(given, message):
    with pytest.raises(TypeError, match=message):
        EngineArgs.build(**given)


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


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(verify_every=10), "verify_every=10: only used with verify='sample'"),
        (
            dict(capture_sizes=(1, 2), max_capture_size=8),
            "max_capture_size=8 and capture_sizes=.1, 2.: give one",
        ),
        (dict(all_reduce="one-shot"), "all_reduce='one-shot': only used with tensor_parallel"),
        (dict(gpu_memory_utilization=0.5), "gpu_memory_utilization: the cpu's KV cache"),
        (dict(num_speculative_tokens=4), "num_speculative_tokens=4: only used with .* got no "),
    ],
)
def test_an_option_nothing_would_read_is_refused_by_name(given, message):
    from ostinato.engine.api.arguments import refuse_ignored

    args = EngineArgs.build("tiny", **given)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        refuse_ignored(args, torch.device("cpu"))
    # The same options where something reads them pass; mode "none" keeps the ladder's.
    fine = EngineArgs.build("tiny", verify="sample", verify_every=10, tensor_parallel_size=2)
    refuse_ignored(fine, torch.device("cpu"))
    refuse_ignored(EngineArgs.build("tiny", gpu_memory_utilization=0.5), torch.device("cuda"))
    refuse_ignored(EngineArgs.build("tiny", mode="none", max_capture_size=8), torch.device("cpu"))
    refuse_ignored(EngineArgs.build("tiny", capture_sizes=(1, 2)), torch.device("cpu"))
    refuse_ignored(EngineArgs.build("tiny", speculative="ngram", num_speculative_tokens=4),
                   torch.device("cpu"))  # fmt: skip


def test_a_draft_count_beside_a_speculative_config_is_refused_for_its_own_k():
    from ostinato.engine.api.arguments import refuse_ignored
    from ostinato.engine.spec.speculative import SpeculativeConfig

    config = SpeculativeConfig("ngram", 3)
    args = EngineArgs.build("tiny", speculative=config, num_speculative_tokens=4)
    with pytest.raises(ValueError, match=r"got a SpeculativeConfig \(give its k instead\)"):
        refuse_ignored(args, torch.device("cpu"))
    refuse_ignored(EngineArgs.build("tiny", speculative=config), torch.device("cpu"))


def test_a_gpu_index_with_several_ranks_is_refused_as_ignored():
    from ostinato.engine.api.arguments import refuse_ignored

    for sizes in (dict(tensor_parallel_size=2), dict(data_parallel_size=2)):
        args = EngineArgs.build("tiny", device="cuda:1", **sizes)
        with pytest.raises(ValueError, match="device='cuda:1': with 2 ranks .* CUDA_VISIBLE"):
            refuse_ignored(args, torch.device("cuda", 1))
        refuse_ignored(EngineArgs.build("tiny", **sizes), torch.device("cuda"))
    refuse_ignored(EngineArgs.build("tiny", device="cuda:1"), torch.device("cuda", 1))


def test_the_ladder_ends_at_a_steps_token_budget_up_to_2048_unless_asked_or_decode_only():
    from ostinato.config import GraphConfig, default_capture_sizes
    from ostinato.engine.api.startup import capture_limit
    from ostinato.engine.core.limits import EngineLimits
    from ostinato.modes import GraphMode

    limits = EngineLimits(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=1024,
                          block_size=16)  # fmt: skip
    for mode in (None, GraphMode.FULL, GraphMode.FULL_AND_PIECEWISE, GraphMode.PIECEWISE):
        assert capture_limit(None, mode, limits) == 2048
    assert capture_limit(None, GraphMode.FULL_DECODE_ONLY, limits) == 512
    assert capture_limit(96, GraphMode.FULL, limits) == 96
    long = EngineLimits(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=8192,
                        block_size=16)  # fmt: skip
    assert capture_limit(None, None, long) == 2048  # (larger steps: bound by the device)
    assert capture_limit(4096, None, long) == 4096
    assert GraphArgs().max_capture_size is None  # the default is the budget, not a number
    config = GraphConfig(max_capture_size=2048, max_num_tokens=2048)
    assert config.sizes == tuple(default_capture_sizes(2048))
    assert config.sizes[-13:] == (512, *range(640, 2049, 128))
