"""The engine's memory plan on made-up device sizes: what it reserves for logits when
decoding requests carry draft tokens."""

import torch

from ostinato.engine.config import ModelConfig
from ostinato.engine.limits import EngineLimits
from ostinato.engine.memory import plan_memory
from ostinato.engine.presets import shape

GIB = 2**30


def plan(decode_query_len):
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
        max_capture_tokens=512,
        decode_query_len=decode_query_len,
    )


def test_speculative_decoding_reserves_logits_for_every_draft_row():
    # A verify step holds 1 + k rows of float32 logits per request, in the eager path and
    # in the decode graphs: 64 x 4 extra rows of a 128256-word vocabulary, twice.
    plain, spec = plan(1), plan(5)
    extra = 64 * 4 * 128256 * 4
    assert spec.activations - plain.activations == 2 * extra
    assert spec.graphs - plain.graphs == 2 * extra
    assert spec.num_blocks < plain.num_blocks
