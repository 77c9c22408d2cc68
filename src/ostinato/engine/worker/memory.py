"""Sizing the KV cache from device memory, before anything large is allocated.

vLLM's convention: the engine may use ``gpu_memory_utilization`` of the device's total
memory, less what other processes already hold. From that budget come the weights
(counted exactly from the model's parameter shapes), the activations of one step and the
graph pool (estimated), and the rest goes to KV blocks, never more than the scheduler
could ever use (every sequence at ``max_model_len``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ostinato.distributed.groups import TensorParallel
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.model.lora import LoraShape, slot_bytes

logger = logging.getLogger(__name__)
MiB = 2**20


class EngineMemoryError(MemoryError):
    """The model, its KV cache and its graphs do not fit; the message names the numbers."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per use and the KV blocks chosen. ``budget`` is what the engine may use."""

    budget: int
    weights: int
    activations: int
    graphs: int
    kv_block: int
    num_blocks: int
    upgrade: int = 0  # of ``graphs``: a staged upgrade's share, its graphs' budget

    def summary(self) -> str:
        """One line for the start-up log."""
        return (
            f"weights {self.weights / MiB:.0f} MiB, KV cache {self.num_blocks} blocks "
            f"({self.num_blocks * self.kv_block / MiB:.0f} MiB), activations "
            f"~{self.activations / MiB:.0f} MiB, graphs ~{self.graphs / MiB:.0f} MiB, of a "
            f"budget of {self.budget / MiB:.0f} MiB"
        )


def weight_bytes(config: ModelConfig, dtype: torch.dtype, tp: TensorParallel | None = None) -> int:
    """Exact parameter bytes of ``DecoderModel(config, tp)`` (this rank's shard) in ``dtype``."""
    with torch.device("meta"):
        model = DecoderModel(config, tp)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def rope_table_bytes(config: ModelConfig, max_model_len: int, dtype: torch.dtype) -> int:
    """Bytes of the RoPE table a model of ``max_model_len`` positions holds
    (``DecoderModel(max_positions=...)``: cos and sin of each, in ``dtype``)."""
    return max_model_len * 2 * config.head_dim * dtype.itemsize


def kv_block_bytes(
    config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> int:
    """Bytes of one KV block over all layers (keys and values), on one of ``tp_size`` ranks."""
    heads = config.num_kv_heads // tp_size
    return 2 * config.num_layers * block_size * heads * config.head_dim * dtype.itemsize


def activation_bytes(
    config: ModelConfig, num_tokens: int, num_seqs: int, dtype: torch.dtype
) -> int:
    """An upper estimate of the live tensors of one forward pass over ``num_tokens`` rows
    plus the logits of ``num_seqs`` rows, counted in float32 as sampling casts them
    (hidden, residual, qkv, gate/up, SiLU product, attention output, twice over for
    temporaries)."""
    c = config
    per_token = 4 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    per_token += 3 * c.intermediate_size + c.num_heads * c.head_dim
    return 2 * num_tokens * per_token * dtype.itemsize + 2 * num_seqs * c.vocab_size * 4


# Measured on the H200 as the pool's own segments: 34 MiB for the tiny test model, whose
# activations are a few hundred KiB.
GRAPH_POOL_MARGIN = 40 * MiB


def graph_pool_bytes(
    config: ModelConfig, max_capture_tokens: int, dtype: torch.dtype, decode_rows: int = 0
) -> int:
    """Estimate of the shared graph pool: graphs are captured largest first and share
    one pool, so it holds about one forward pass at the largest size, plus the float32
    logits of the largest decode graph (decode graphs end in the LM head; ``decode_rows``
    of them), plus a margin for the allocator's segments (blocks of 1 to 10 MiB come in
    20 MiB segments, smaller ones in 2 MiB segments per stream)."""
    if max_capture_tokens <= 0:
        return 0
    rows = min(decode_rows, max_capture_tokens)
    return activation_bytes(config, max_capture_tokens, rows, dtype) + GRAPH_POOL_MARGIN


# Peak bytes per logit element of ``sample`` (softmax, the sort's values and int64
# indices, the top-p mask's temporaries, the exponential race): 25, rounded up; and the
# buffers beside the graphs: the adjusted variants' float32 bias, the counts' table, and FULL
# mode's logits buffer (at most float32).
SAMPLING_BYTES_PER_LOGIT = 28 + 4 + 4 + 4


def sampling_graph_bytes(config: ModelConfig, decode_rows: int) -> int:
    """Estimate of what the sampling graphs add: their largest size samples
    ``decode_rows`` rows of the full vocabulary (``GraphSampler``), and their buffers."""
    return decode_rows * config.vocab_size * SAMPLING_BYTES_PER_LOGIT


def plan_memory(
    config: ModelConfig,
    dtype: torch.dtype,
    limits: EngineLimits,
    *,
    free: int,
    total: int,
    utilization: float,
    max_capture_tokens: int,
    num_blocks: int | None = None,
    tp: TensorParallel | None = None,
    decode_query_len: int = 1,
    upgrade_tokens: int = 0,
    lora: LoraShape | None = None,
) -> MemoryPlan:
    """Chooses the KV block count, or raises ``EngineMemoryError``.

    ``num_blocks`` given: it must fit. Otherwise as many blocks as fit in the budget, up
    to every sequence at ``max_model_len``, and at least one such sequence.
    ``decode_query_len``: rows of logits per decoding request (1 + k when speculating).
    ``upgrade_tokens``: the largest capture of a staged upgrade's graphs (0: none), which
    are reserved beside the first stage's (``MemoryPlan.upgrade``). ``lora``: the LoRA
    slots the model holds, counted with its weights.
    """
    budget = int(utilization * total) - (total - free)
    tp = tp or TensorParallel()
    weights = weight_bytes(config, dtype, tp) + rope_table_bytes(
        config, limits.max_model_len, dtype
    )
    weights += slot_bytes(config, lora, dtype) if lora is not None else 0
    logit_rows = limits.max_num_seqs * decode_query_len
    acts = activation_bytes(config, limits.max_num_batched_tokens, logit_rows, dtype)
    graphs, upgrade = _graph_bytes(
        config, dtype, max_capture_tokens, upgrade_tokens, logit_rows, decode_query_len
    )
    block = kv_block_bytes(config, limits.block_size, dtype, tp.size)
    wanted = num_blocks if num_blocks is not None else limits.full_blocks
    least = num_blocks if num_blocks is not None else limits.blocks_per_seq + 1
    room = budget - weights - acts - graphs
    fits = max(0, room // block) if room > 0 else 0
    if fits < least:
        needs = (weights, least * block, graphs + acts)
        raise EngineMemoryError(_too_little(needs, least, budget, utilization, free, total))
    chosen = min(wanted, fits)
    if chosen < wanted:
        logger.warning(
            "ostinato: KV cache holds %d blocks, %d would let every sequence reach "
            "max_model_len at once; requests will be preempted when it is full",
            chosen,
            wanted,
        )
    return MemoryPlan(budget, weights, acts, graphs, block, chosen, upgrade)


def _graph_bytes(
    config: ModelConfig,
    dtype: torch.dtype,
    max_capture_tokens: int,
    upgrade_tokens: int,
    logit_rows: int,
    decode_query_len: int,
) -> tuple[int, int]:
    """(every graph pool's bytes, the staged upgrade's share of them): the first stage's
    graphs, the upgrade's beside them, and the sampling graphs of one-token decodes."""
    graphs = graph_pool_bytes(config, max_capture_tokens, dtype, logit_rows)
    upgrade = graph_pool_bytes(config, upgrade_tokens, dtype, logit_rows) if upgrade_tokens else 0
    graphs += upgrade
    if max_capture_tokens > 0 and decode_query_len == 1:  # the sampling graphs
        graphs += sampling_graph_bytes(config, min(logit_rows, max_capture_tokens))
    return graphs, upgrade


def _too_little(
    needs: tuple[int, int, int], least: int, budget: int, utilization: float, free: int, total: int
) -> str:
    """Why the plan fails: ``needs`` (weights, the least KV cache, graphs and activations)
    against what ``gpu_memory_utilization`` leaves, and what to change."""
    weights, kv, rest = needs
    return (
        f"device memory: the model needs {weights / MiB:.0f} MiB of weights + "
        f"{kv / MiB:.0f} MiB of KV cache ({least} blocks) + ~"
        f"{rest / MiB:.0f} MiB for graphs and activations, but only "
        f"{max(budget, 0) / MiB:.0f} MiB may be used (gpu_memory_utilization={utilization} "
        f"of {total / MiB:.0f} MiB, {(total - free) / MiB:.0f} MiB already in use). Lower "
        "max_model_len, max_num_batched_tokens or max_capture_size, use a smaller dtype, "
        "raise gpu_memory_utilization, or free device memory."
    )


@dataclass(frozen=True)
class GraphMemoryCheck:
    """What the KV sizing reserved for graphs against what their capture took from the
    pool (``measured``, the capture report's total). ``over`` when the graphs took more
    than was reserved (the budget is over-committed by the difference)."""

    reserved: int
    measured: int

    @property
    def over(self) -> bool:
        return self.measured > self.reserved

    def summary(self) -> str:
        """Both numbers, and what the difference means."""
        both = (
            f"graphs took {self.measured / MiB:.0f} MiB of pool; "
            f"{self.reserved / MiB:.0f} MiB were reserved for them when the KV cache was sized"
        )
        if self.over:
            return (
                f"{both}: the budget is over-committed by "
                f"{(self.measured - self.reserved) / MiB:.0f} MiB (lower "
                "gpu_memory_utilization or max_capture_size if memory runs out)"
            )
        return f"{both} ({(self.reserved - self.measured) / MiB:.0f} MiB held back unused)"


def check_graph_memory(plan: MemoryPlan, measured: int) -> GraphMemoryCheck:
    """Compares the reserve with the capture's measured pool bytes; a reserve that was too
    small is logged as a warning with both numbers, one too large at info."""
    check = GraphMemoryCheck(plan.graphs, measured)
    if check.over:
        logger.warning("ostinato: %s", check.summary())
    else:
        logger.info("ostinato: %s", check.summary())
    return check


def check_utilization(value: float) -> float:
    """``value`` if it is a fraction in (0, 1]; else ``ValueError`` naming the option."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {value!r}")
    return float(value)
