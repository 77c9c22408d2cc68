"""The engine's memory plan on made-up device sizes: what it reserves for logits when
decoding requests carry draft tokens, and for the sampling graphs."""

import torch

from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.presets import shape
from ostinato.engine.worker.memory import (
    SAMPLING_BYTES_PER_LOGIT,
    MemoryPlan,
    check_graph_memory,
    plan_memory,
)

GIB = 2**30


def plan(decode_query_len, max_capture_tokens=512):
    config = ModelConfig.from_hf(shape("llama-1.5b"))
    limits = EngineLimits(
        max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096, block_size=16
    )
    return plan_memory(
        config,
        torch.bfloat16,
        limits,
        free=8 * GIB,
        total=8 * GIB,  # small enough that the KV cache takes what is left
        utilization=0.9,
        max_capture_tokens=max_capture_tokens,
        decode_query_len=decode_query_len,
    )


def test_speculative_decoding_reserves_logits_for_every_draft_row():
    # A verify step holds 1 + k rows of float32 logits per request, in the eager path and
    # in the decode graphs: 64 x 4 extra rows of a 128256-word vocabulary, twice.
    plain, spec = plan(1), plan(5)
    extra = 64 * 4 * 128256 * 4
    assert spec.activations - plain.activations == 2 * extra
    # Plain decoding also samples in graphs of its own (a speculative engine's verify
    # step samples its rows itself): 64 rows of the vocabulary's sampling workspace.
    sampling = 64 * 128256 * SAMPLING_BYTES_PER_LOGIT
    assert spec.graphs - plain.graphs == 2 * extra - sampling
    assert spec.num_blocks < plain.num_blocks


def test_sampling_graphs_are_reserved_only_where_graphs_are_captured():
    with_graphs, without = plan(1), plan(1, max_capture_tokens=0)
    assert with_graphs.graphs > 64 * 128256 * SAMPLING_BYTES_PER_LOGIT
    assert without.graphs == 0


def test_the_graph_reserve_is_checked_against_what_capture_took(caplog):
    plan = MemoryPlan(
        budget=8 << 30,
        weights=1 << 30,
        activations=0,
        graphs=100 << 20,
        kv_block=1 << 20,
        num_blocks=10,
    )
    with caplog.at_level("INFO", logger="ostinato.engine.worker.memory"):
        under = check_graph_memory(plan, 40 << 20)
        over = check_graph_memory(plan, 130 << 20)
    assert not under.over and "60 MiB held back unused" in under.summary()
    assert over.over and "over-committed by 30 MiB" in over.summary()
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "130 MiB of pool; 100 MiB were reserved" in warned[0].message


def test_the_plan_counts_the_rope_table_the_model_holds_with_its_weights():
    from ostinato.engine.model.decoder import DecoderModel
    from ostinato.engine.worker.memory import rope_table_bytes, weight_bytes

    config = ModelConfig.from_hf(shape("tiny"))
    model = DecoderModel(config, max_positions=300).to(torch.bfloat16)
    held = model.rope_table.numel() * model.rope_table.element_size()
    assert rope_table_bytes(config, 300, torch.bfloat16) == held
    big = ModelConfig.from_hf(shape("llama-1.5b"))
    table = rope_table_bytes(big, 4096, torch.bfloat16)
    assert plan(1).weights == weight_bytes(big, torch.bfloat16) + table
