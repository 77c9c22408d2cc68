"""Paged attention on Ascend through ``torch_npu``, captured as updatable tasks.

Not run on Ascend hardware here: no NPU was available to this project. The calls follow
torch_npu's documented signatures (``npu_fused_infer_attention_score`` in the TND layout
with ``sparse_mode=3``, ``_npu_reshape_and_cache``); the CPU tests run this backend
against a fake torch_npu that implements those semantics (tests/fake_torch_npu.py).

The fused attention op takes the step's query and KV lengths as host lists, which a
captured graph would freeze. Inside a capture the op is therefore issued through
``ostinato.param_updates.capture_updatable``: the platform captures it as a task group
and re-issues it with each replay's lengths. Graph support is uniform single-token
decode (as vLLM-Ascend's decode-only graphs): a captured step of N rows is always N
one-token requests, padding rows being requests with no keys, so the op's shapes never
change between capture and update; every other batch runs attention eagerly (NONE, or
between the pieces of a PIECEWISE graph).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import torch

from ostinato.context import get_forward_context
from ostinato.engine.model.attention import AttentionMetadata, Rope
from ostinato.engine.model.attention_op import StepAttention
from ostinato.errors import PlatformError
from ostinato.param_updates import capture_updatable, capturing_tasks
from ostinato.resolution import AttentionGraphSupport

MASK_SIZE = 2048
"""The fused op's compressed causal mask for ``sparse_mode=3`` is 2048 x 2048."""
SPARSE_MODE_CAUSAL = 3
"""Bottom-right aligned causal attention: query i of n sees keys up to L - n + i."""


@dataclass(frozen=True)
class FiaLengths:
    """The fused op's host parameters for one step: per request, its cumulative query end
    (``query_ends``) and its key count (``kv_lens``); ``table_rows`` block-table rows,
    one per request (padding rows form requests with no keys)."""

    query_ends: list[int]
    kv_lens: list[int]
    table_rows: int


def fia_lengths(meta: AttentionMetadata, rows: int, table_capacity: int) -> FiaLengths:
    """The lengths for a step of ``rows`` rows: a uniform decode that fits the block
    table (every request one token; the layout of a captured step) keeps one request per
    row, so the same size always has the same request count; any other step keeps its
    requests and puts all padding rows in one request with no keys."""
    real = sum(meta.query_lens)
    if real > rows or len(meta.seq_lens) != len(meta.query_lens):
        raise ValueError(
            f"attention metadata: {len(meta.query_lens)} query lengths summing to {real} "
            f"and {len(meta.seq_lens)} sequence lengths, for a step of {rows} rows"
        )
    if all(q == 1 for q in meta.query_lens) and rows <= table_capacity:
        pad = rows - real
        return FiaLengths(list(range(1, rows + 1)), [*meta.seq_lens, *[0] * pad], rows)
    ends = list(itertools.accumulate(meta.query_lens))
    kv = list(meta.seq_lens)
    if real < rows:
        ends.append(rows)
        kv.append(0)
    return FiaLengths(ends, kv, len(ends))


class AscendAttention:
    """Paged attention through ``torch_npu.npu_fused_infer_attention_score`` (TND layout,
    causal), K/V written with ``torch_npu._npu_reshape_and_cache``.

    Guarantees: outside a capture, and on platforms that update nothing, each call issues
    the op once with the step's lengths; inside a capture on the npu platform, the op is
    an updatable task whose workspace is sized at capture for the longest sequences the
    block table can hold (``max_model_len``), kept per captured size and shared by the
    layers; a replay of that graph runs it with the lengths of the step replayed.
    The host lengths must be exact. Padding rows are requests with no
    keys: their output is whatever the op writes for no keys.
    """

    graph_support = AttentionGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    applies_rope = False

    def __init__(self) -> None:
        try:
            import torch_npu
        except ImportError as exc:
            raise PlatformError(
                "AscendAttention needs torch_npu (pip install torch-npu matching your torch "
                "and CANN versions); on other devices use the default backend"
            ) from exc
        self.npu = torch_npu
        self.workspaces: dict[int, torch.Tensor] = {}  # captured rows -> workspace
        self.masks: dict[torch.device, torch.Tensor] = {}  # [MASK_SIZE, MASK_SIZE] bool

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        rope: Rope | None = None,
    ) -> None:
        """K and V (``[n, kv_heads, head_dim]``) at their slots; the model rotated K."""
        if rope is not None:
            raise ValueError("AscendAttention does not apply RoPE (applies_rope is False)")
        self.npu._npu_reshape_and_cache(
            key=k.contiguous(),
            value=v.contiguous(),
            key_cache=k_cache,
            value_cache=v_cache,
            slot_indices=slot_mapping.to(torch.int32),
        )

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        rope: Rope | None = None,
    ) -> None:
        if rope is not None:
            raise ValueError("AscendAttention does not apply RoPE (applies_rope is False)")
        # Fixed addresses for the task: the contiguous query and an (unused) LSE output
        # are made once here, inside the capture, and reused by every update.
        query = q.contiguous()
        lse = torch.empty(0, dtype=q.dtype, device=q.device)
        if not capturing_tasks():
            self._issue(query, k_cache, v_cache, meta, scale, out, lse, None)
            return
        step = get_forward_context().attn_metadata
        if not isinstance(step, StepAttention) or step.metadata is not meta:
            raise RuntimeError(
                "AscendAttention captured outside the engine's attention op: the forward "
                "context must hold the StepAttention whose metadata this call received"
            )
        workspace = self._workspace(query, k_cache, v_cache, meta, scale)

        def issue(replayed: StepAttention) -> None:
            self._issue(query, k_cache, v_cache, replayed.metadata, scale, out, lse, workspace)

        capture_updatable(issue, step, name="ascend attention")

    def _issue(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
        workspace: torch.Tensor | None,
    ) -> None:
        lengths = fia_lengths(meta, query.shape[0], meta.block_tables.shape[0])
        tensors, options = self._arguments(query, k_cache, v_cache, meta, lengths, scale)
        self.npu.npu_fused_infer_attention_score.out(
            *tensors, **options, workspace=workspace, out=[out, lse]
        )

    def _arguments(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        lengths: FiaLengths,
        scale: float,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], dict[str, Any]]:
        """The fused op's query, key and value (the caches as ``[blocks, block_size,
        kv_heads * head_dim]``) and its keyword arguments for ``lengths``."""
        blocks, block_size, kv_heads, head_dim = k_cache.shape
        key = k_cache.view(blocks, block_size, kv_heads * head_dim)
        value = v_cache.view(blocks, block_size, kv_heads * head_dim)
        tables = meta.block_tables
        if lengths.table_rows <= tables.shape[0]:
            table = tables[: lengths.table_rows]
        else:  # a full batch plus padding rows: the no-key request's row is never read
            table = torch.cat([tables, tables[:1]])
        options = dict(
            atten_mask=self._mask(query.device),
            block_table=table,
            input_layout="TND",
            block_size=block_size,
            actual_seq_lengths=lengths.query_ends,
            actual_seq_lengths_kv=lengths.kv_lens,
            num_heads=query.shape[1],
            num_key_value_heads=kv_heads,
            scale=scale,
            sparse_mode=SPARSE_MODE_CAUSAL,
        )
        return (query, key, value), options

    def _workspace(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The workspace of a captured size, sized for every request at the longest
        length the block table holds (an update may bring any length up to it)."""
        rows = query.shape[0]
        if rows not in self.workspaces:
            lengths = fia_lengths(meta, rows, meta.block_tables.shape[0])
            longest = meta.block_tables.shape[1] * k_cache.shape[1]
            widest = replace(lengths, kv_lens=[longest] * len(lengths.kv_lens))
            tensors, options = self._arguments(query, k_cache, v_cache, meta, widest, scale)
            get = self.npu._npu_fused_infer_attention_score_get_max_workspace
            self.workspaces[rows] = get(*tensors, **options)
        return self.workspaces[rows]

    def _mask(self, device: torch.device) -> torch.Tensor:
        if device not in self.masks:
            ones = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device)
            self.masks[device] = ones.triu(1)  # True: masked out
        return self.masks[device]
