"""A Llama-family decoder (Llama 3, Qwen2, Qwen3) over a paged KV cache.

Numerics follow Hugging Face transformers' implementations (RMSNorm in float32, RoPE
with rotate-half, SwiGLU), so logits match theirs on the same weights. The forward pass
takes flat token rows (``[num_tokens]``); attention is the custom op
``ostinato::attention``, which reads the step's metadata and KV cache from the ostinato
forward context, so the same module runs eagerly, padded, captured, or compiled.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ostinato.context import get_forward_context
from ostinato.distributed.collectives import all_gather_last_dim
from ostinato.distributed.groups import TensorParallel
from ostinato.engine.kernels.gemm_launch import rope_head_dim
from ostinato.engine.kernels.launch import without_pdl
from ostinato.engine.kernels.launch_rules import rules
from ostinato.engine.kernels.options import KernelOptions
from ostinato.engine.model import (  # noqa: F401  (register torch.ops.ostinato)
    all_reduce_norm_op,
    attention_op,
    embed_rope_op,
    fused_ops,
    norm_op,
)
from ostinato.engine.model.attention import TritonAttention
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.linear import Linear
from ostinato.engine.model.lora import (
    LoraRows,
    LoraShape,
    LoraWeights,
    RowDelta,
    expands_in_kernel,
    lora_step,
    shrinks_in_norm,
)
from ostinato.engine.model.rope import apply_rope, rope_cos_sin, rope_inv_freq, rope_table


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as transformers does (the op ``ostinato::rms_norm``:
    one kernel per norm on CUDA)."""

    def __init__(self, dim: int, eps: float, kernels: KernelOptions | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = (kernels or KernelOptions()).as_built()  # read where the kernel launches

    def reset_parameters(self) -> None:
        """Ones, as at construction."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ostinato.rms_norm(x, self.weight, self.eps, self.kernels.pdl)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of ``x + residual``, ``x + residual``), in one kernel on CUDA."""
        pdl = self.kernels.pdl
        return torch.ops.ostinato.add_rms_norm(x, residual, self.weight, self.eps, pdl)

    def add_delta(
        self, x: torch.Tensor, residual: torch.Tensor, delta: RowDelta | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``add(x + each row's LoRA delta, residual)``: with a ``delta`` (the projection
        before left it: ``LoraRows.project_for_norm``) the norm's kernel adds it first."""
        if delta is None:
            return self.add(x, residual)
        pdl = self.kernels.pdl
        s, b, slots, max_loras = delta.s, delta.b, delta.slots, delta.max_loras
        return torch.ops.ostinato.lora_add_rms_norm(
            x, residual, self.weight, self.eps, s, b, slots, max_loras, pdl
        )

    def add_delta_shrink(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        delta: RowDelta | None,
        shrink: tuple[torch.Tensor, torch.Tensor, int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``add_delta`` (without a residual, the norm of ``x``, which is the sum), and
        with ``shrink`` (``LoraRows.shrink``: where ``shrinks_in_norm``) each normed
        row's LoRA shrink by its slot for the projection after it, from the same kernel;
        (normed rows, sum, shrink or None)."""
        if shrink is None:
            if residual is None:
                return self(x), x, None
            return *self.add_delta(x, residual, delta), None
        from ostinato.engine.kernels.rms_norm import Shrink, rms_norm_rows  # (CUDA only)

        a, slots, max_loras = shrink
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        s = torch.empty((x.shape[0], a.shape[0] // max_loras), dtype=x.dtype, device=x.device)
        total = torch.empty_like(x) if residual is not None else None
        expand = None if delta is None else (delta.s, delta.b, delta.slots, delta.max_loras)
        rms_norm_rows(
            x, residual, self.weight, self.eps, out, total, self.kernels.pdl, expand,
            Shrink(a, s, slots, max_loras),
        )  # fmt: skip
        return out, x if total is None else total, s

    def reduce_add(
        self, x: torch.Tensor, residual: torch.Tensor, tp: TensorParallel
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``add(sum of x over tp's group, residual)``: ``x`` is this rank's partial sum.
        Where the group may fuse it (``TensorParallel.fusable_group``), one op that runs
        the all-reduce inside the norm where start-up measured that faster
        (``all_reduce_norm_op``); else the group's all-reduce, then the norm."""
        group = tp.fusable_group()
        if group is None:
            return self.add(tp.all_reduce(x), residual)
        return torch.ops.ostinato.tp_all_reduce_add_rms_norm(
            x, residual, self.weight, self.eps, group, self.kernels.pdl
        )


@dataclass(frozen=True)
class RowStats:
    """What a fused block hands the norm after it besides ``x`` and the residual: the
    row statistics of their sum (``stats`` ``[MAX_ROWS, hidden / 16]`` float32, per row
    and 16 columns the sum of squares) and the plan of the projection that stored them,
    which says for which row counts it did (``linear.kernel_rows``)."""

    stats: torch.Tensor
    plan: tuple[int, ...]

    @staticmethod
    def args(stats: RowStats | None) -> tuple[torch.Tensor | None, list[int]]:
        """The ``stats, stats_plan`` arguments of the fused norm ops."""
        return (None, []) if stats is None else (stats.stats, list(stats.plan))


def hands_row_stats(kernels: KernelOptions, tp: TensorParallel) -> bool:
    """Whether the O and down projections store the row statistics of their sums with
    the residual (``Linear.forward_stats``) for the fused norm after them: fused layers
    on one GPU (under tensor parallelism the residual is added after an all-reduce), as
    ``LaunchRules.row_stats`` says."""
    return rules().row_stats and kernels.fused_layers and tp.group is None


class Attention(nn.Module):
    """QKV projection, RoPE, the ``ostinato::attention`` op, output projection.

    With ``rope_in_attention`` the op gets q and k unrotated, with ``cos`` and ``sin``,
    and the attention backend rotates them (k as it is written to the cache, q as the
    kernel loads it): no rotation kernels, and q, k and v stay views of the QKV output.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        tp: TensorParallel,
        kernels: KernelOptions | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tp
        self.kernels = (kernels or KernelOptions()).as_built()  # read where the fused op launches
        # Column-parallel q/k/v (whole heads per rank), row-parallel o with an all-reduce.
        self.heads = tp.split(config.num_heads, "num_attention_heads")
        self.kv_heads = tp.split(config.num_kv_heads, "num_key_value_heads")
        self.head_dim = config.head_dim
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        # The o bias lives on rank 0 only, so the all-reduce adds it once.
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias and tp.rank == 0)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.rope_in_attention = False  # set by the runner from its attention backend
        self.row_stats = hands_row_stats(self.kernels, tp)

    def project(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        lora: LoraRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[n, heads, d]``, k and v ``[n, kv_heads, d]`` for rows ``x`` (each row's
        LoRA delta added where ``lora``): QK-normed (Qwen3) and rotated (unless ``cos``
        is None)."""
        n = x.shape[0]
        if lora is None:
            qkv = self.qkv_proj(x)
        else:
            qkv = lora.project(self.layer, "qkv", self.qkv_proj, x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.heads, self.head_dim)
        k = k.view(n, self.kv_heads, self.head_dim)
        v = v.view(n, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is None or sin is None:
            return q, k, v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, reduce: bool = True
    ) -> torch.Tensor:
        """The block's output; with ``reduce`` False under tensor parallelism this rank's
        partial sum of it, for the norm after it to reduce (``RMSNorm.reduce_add``). (A
        LoRA step: ``attend``, then ``LoraRows.project_for_norm``.)"""
        # v (and with rope_in_attention q and k) stay strided views of the QKV
        # projection: the backend takes any token and head strides, and a copy to make
        # them contiguous would be a kernel per layer. ``out`` is contiguous.
        o = self.o_proj(self.attend(x, cos, sin, None))
        return self.tp.all_reduce(o) if reduce else o

    def attend(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoraRows | None,
        shrunk: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention's output rows (``[n, heads * head_dim]``), before the O
        projection; ``shrunk``: the rows' LoRA shrink, where the norm made it
        (``rope_kv_in_kernel``)."""
        if lora is not None:
            q_rows = self._lora_queries(x, cos, sin, lora, shrunk)
        else:
            q_rows = self._queries_in_kernel(x, cos, sin)
        if q_rows is not None:  # (the keys and values are in the cache)
            out = torch.empty(
                (x.shape[0], self.heads, self.head_dim), dtype=x.dtype, device=x.device
            )
            torch.ops.ostinato.attention(q_rows, None, None, out, self.layer, self.scale, cos, sin)
        elif self.rope_in_attention:
            q, k, v = self.project(x, None, None, lora)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            torch.ops.ostinato.attention(q, k, v, out, self.layer, self.scale, cos, sin)
        else:
            q, k, v = self.project(x, cos, sin, lora)
            out = torch.empty_like(q)
            torch.ops.ostinato.attention(q, k, v, out, self.layer, self.scale)
        return out.view(x.shape[0], self.q_size)

    def _queries_in_kernel(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        """Where ``LaunchRules.rope_kv_unfused`` and the backend rotates at the cache
        write, eagerly (the FULL graphs of an unfused layer: under tensor parallelism
        the norm before it ran inside the all-reduce): the QKV projection, the head
        norms and the K/V write in the fused layers' one kernel, where its plan runs
        the Triton GEMM for these rows (``fused_ops.qkv_rope_kv_rows``); the query
        heads, unrotated. Else None."""
        if not (rules().rope_kv_unfused and self.rope_in_attention):
            return None
        if torch.compiler.is_compiling():  # (compiled pieces keep the unfused ops)
            return None
        qkv = self.qkv_proj
        return fused_ops.qkv_rope_kv_rows(
            x, qkv.weight, qkv.bias, qkv.counters, list(qkv.plan), self._heads_of(), cos, sin,
            self.kernels.pdl,
        )  # fmt: skip

    def _heads_of(self) -> fused_ops.HeadsOf:
        """This layer's heads as the ROPE_KV epilogue takes them."""
        q_norm, k_norm = self.q_norm, self.k_norm
        return fused_ops.HeadsOf(
            self.layer, self.heads, self.kv_heads,
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0,
        )  # fmt: skip

    def rope_kv_in_kernel(self, x: torch.Tensor) -> bool:
        """Whether a LoRA step's QKV rows end in the ROPE_KV epilogue's work (head norms,
        RoPE, the K/V write) inside a LoRA kernel: its expand runs as a kernel, and the
        Triton backend rotates and caches (its layout; a power-of-two head dim)."""
        if not (self.rope_in_attention and expands_in_kernel(x) and rope_head_dim(self.head_dim)):
            return False
        return isinstance(get_forward_context().attn_metadata.backend, TritonAttention)

    def _lora_queries(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoraRows,
        shrunk: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Where ``rope_kv_in_kernel``: the QKV projection, each row's delta, the head
        norms and the K/V write in one kernel where the norm shrank the rows (``shrunk``:
        the GEMM's LoRA segment), else two (the joint GEMM, then ``lora_expand_qkv``);
        the query heads, unrotated. Else None."""
        if not self.rope_kv_in_kernel(x):
            return None
        rope = fused_ops.rope_kv(self._heads_of(), cos, sin)  # (Triton: CUDA only)
        q = torch.empty((x.shape[0], self.q_size), dtype=x.dtype, device=x.device)
        if shrunk is not None:
            return lora.segment_rope_kv(self.layer, self.qkv_proj, x, shrunk, rope, q)
        return lora.project_rope_kv(self.layer, self.qkv_proj, x, rope, q)

    def forward_fused(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        cos: torch.Tensor,
        sin: torch.Tensor,
        stats: RowStats | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, RowStats | None]:
        """(this block's output for ``norm(x + residual)``, ``x + residual`` (``x``
        itself without a residual), the row statistics of their sum or None):
        ``forward`` with the norm in front, the norm (its sums of squares from
        ``stats`` where ready), the QKV projection and the K/V write as one op
        (``ostinato::norm_qkv``). With ``row_stats`` the output projection stores the
        statistics for the next norm."""
        qkv = self.qkv_proj
        q_norm = self.q_norm.weight if self.q_norm is not None else None
        k_norm = self.k_norm.weight if self.k_norm is not None else None
        n = x.shape[0]
        # The ops' outputs are made here, before both: a splitting op (as the QKV op is
        # declared, should a compiled model call it) writes into buffers a graph holds.
        # Compiled models run the layers unfused (``forward``), so today only the eager
        # model, and the FULL graphs that capture it, come here.
        qkv_rows = torch.empty((n, qkv.out_features), dtype=x.dtype, device=x.device)
        total = torch.empty_like(x) if residual is not None else x.new_empty(0)
        out = torch.empty((n, self.heads, self.head_dim), dtype=x.dtype, device=x.device)
        torch.ops.ostinato.norm_qkv(
            x, residual, norm.weight, norm.eps, qkv.weight, qkv.bias, qkv.counters,
            list(qkv.plan), q_norm, k_norm, cos, sin, self.layer, self.heads, self.kv_heads,
            qkv_rows, total, self.kernels.pdl, *RowStats.args(stats),
        )  # fmt: skip
        # The queries are the first columns of qkv_rows (the op slices them: no view here).
        torch.ops.ostinato.attention(qkv_rows, None, None, out, self.layer, self.scale, cos, sin)
        total = x if residual is None else total
        out = out.view(n, self.q_size)
        if not self.row_stats:
            return self.tp.all_reduce(self.o_proj(out)), total, None
        o, new = self.o_proj.forward_stats(out, total)
        return o, total, RowStats(new, self.o_proj.plan)


class Mlp(nn.Module):
    """SwiGLU feed-forward with fused gate and up projections."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        kernels: KernelOptions | None = None,
        layer: int = 0,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.layer = layer
        self.inter = tp.split(config.intermediate_size, "intermediate_size")
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, config.hidden_size, bias=False)
        self.kernels = (kernels or KernelOptions()).as_built()  # read where SiLU·mul launches
        self.row_stats = hands_row_stats(self.kernels, tp)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The block's output (``reduce`` as in ``Attention.forward``; a LoRA step:
        ``forward_lora``)."""
        # silu(gate) * up belongs to the gate/up projection: fused into its epilogue where
        # its plan picks the small Triton GEMM, else one ostinato::silu_mul kernel.
        up = self.gate_up_proj.forward_swiglu(x, self.kernels.pdl)
        y = self.down_proj(up)
        return self.tp.all_reduce(y) if reduce else y

    def forward_lora(
        self, x: torch.Tensor, lora: LoraRows, shrunk: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, RowDelta | None]:
        """The block with each row's LoRA delta, the down projection's left for the norm
        after it where it can add it (``LoraRows.project_for_norm``); ``shrunk``: the
        rows' gate/up shrink, where the norm made it (``shrinks_in_norm``)."""
        if shrunk is not None:
            up = lora.segment_swiglu(self.layer, self.gate_up_proj, x, shrunk)
        else:
            up = lora.swiglu(self.layer, self.gate_up_proj, x, self.kernels.pdl)
        return lora.project_for_norm(self.layer, "down", self.down_proj, up)

    def forward_fused(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm: RMSNorm,
        stats: RowStats | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, RowStats | None]:
        """(``forward(norm(x + residual))``, ``x + residual``, the row statistics of their
        sum or None), the norm (from ``stats`` where ready), the gate/up projection and
        SiLU·mul as one op (``ostinato::norm_linear``); with ``row_stats`` the down
        projection stores the statistics for the next norm."""
        gate_up = self.gate_up_proj
        act, total = torch.ops.ostinato.norm_linear(
            x, residual, norm.weight, norm.eps, gate_up.weight, gate_up.counters,
            list(gate_up.plan), True, self.kernels.pdl, *RowStats.args(stats),
        )  # fmt: skip
        if not self.row_stats:
            return self.tp.all_reduce(self.down_proj(act)), total, None
        y, new = self.down_proj.forward_stats(act, total)
        return y, total, RowStats(new, self.down_proj.plan)


# A thread's own unfused row counts (``DecoderModel.unfused_here``), over the model's.
_UNFUSED_HERE: ContextVar[frozenset[int] | None] = ContextVar("unfused_here", default=None)


def _unfused(own: frozenset[int]) -> frozenset[int]:
    """The unfused row counts this thread's steps run: its own choice where it made one
    (``DecoderModel.unfused_here``), else the model's (``own``)."""
    here = _UNFUSED_HERE.get()
    return own if here is None else here


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections. The residual sum is
    carried beside the hidden states and each add happens inside the next norm (as
    vLLM's layers do): ``forward(x, residual)`` returns the MLP's output and the sum
    before it, which the next layer's (or the final) norm adds (unfused under tensor
    parallelism, this rank's partial sum of it: each block's all-reduce happens inside
    the norm after it, ``RMSNorm.reduce_add``). With
    ``KernelOptions.fused_layers`` each norm runs inside the op of the projection after
    it (``fused_ops``): the same function, in fewer kernels; on one GPU the row
    statistics of each sum travel too (``RowStats``, None into the first layer and out
    of unfused ones), so that those norms need not sum their rows' squares first."""

    def __init__(
        self, config: ModelConfig, layer: int, tp: TensorParallel, kernels: KernelOptions
    ) -> None:
        super().__init__()
        self.fused = kernels.fused_layers
        # Row counts at which the fused ops measured slower (``DecoderModel.unfused_rows``).
        self.unfused_rows: frozenset[int] = frozenset()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = Attention(config, layer, tp, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp = Mlp(config, tp, kernels, layer)

    def fuses(self, rows: int, lora: LoraRows | None = None) -> bool:
        """Whether a step of ``rows`` rows runs this layer's fused ops: with fused layers,
        eagerly, without LoRA rows, at a row count where they did not measure slower."""
        if not self.fused or lora is not None or torch.compiler.is_compiling():
            return False
        return rows not in _unfused(self.unfused_rows)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        stats: RowStats | RowDelta | None = None,
        lora: LoraRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, RowStats | RowDelta | None]:
        # ``stats``: what the block before hands this layer's first norm (the fused ops'
        # row statistics, or a LoRA step's down-projection delta), as this returns its own.
        # A step with LoRA rows runs unfused: the fused ops have no place for the deltas.
        # Traced by torch.compile (the piecewise graphs: prefills, mixed steps), the layer
        # runs unfused: its norm and QKV projection then stay inside the graphs, where the
        # fused op would run between them, eagerly, at every size (short prefills are
        # host-bound). The fused kernels serve the eager model, which the runner hands
        # the FULL decode graphs (``ModelRunner._forward_for``).
        if self.fuses(x.shape[0], lora):
            assert not isinstance(stats, RowDelta)  # (a LoRA step fuses no layer)
            attn, norm = self.self_attn, self.input_layernorm
            h, residual, stats = attn.forward_fused(x, residual, norm, cos, sin, stats)
            return self.mlp.forward_fused(h, residual, self.post_attention_layernorm, stats)
        if lora is not None:  # (one GPU: LoRA is refused with tensor parallelism)
            assert not isinstance(stats, RowStats)
            return self._forward_lora(x, residual, cos, sin, stats, lora)
        # Unfused, each block hands its partial sum to the norm after it, which reduces
        # it over the group (under tensor parallelism the returned x is a partial sum).
        tp = self.self_attn.tp
        if residual is None:  # the first layer: x is the embedding
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.reduce_add(x, residual, tp)
        attended = self.self_attn(h, cos, sin, reduce=False)
        h, residual = self.post_attention_layernorm.reduce_add(attended, residual, tp)
        return self.mlp(h, reduce=False), residual, None

    def _forward_lora(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        delta: RowDelta | None,
        lora: LoraRows,
    ) -> tuple[torch.Tensor, torch.Tensor, RowDelta | None]:
        """The unfused layer with each row's LoRA delta. The O and down projections leave
        theirs to the norm after them where it can add it in its kernel (``delta``: the
        last layer's down projection's, returned likewise), one launch less each; where
        ``shrinks_in_norm``, each norm also shrinks its rows for the QKV or gate/up
        group after it, whose GEMM adds the expand (one kernel a group)."""
        attn, mlp = self.self_attn, self.mlp
        shrink = lora.shrink(attn.layer, "qkv") if self._shrinks(x, True) else None
        h, residual, s = self.input_layernorm.add_delta_shrink(x, residual, delta, shrink)
        rows = attn.attend(h, cos, sin, lora, s)
        o, o_delta = lora.project_for_norm(attn.layer, "o", attn.o_proj, rows)
        shrink = lora.shrink(mlp.layer, "gate_up") if self._shrinks(o, False) else None
        norm = self.post_attention_layernorm
        h, residual, s = norm.add_delta_shrink(o, residual, o_delta, shrink)
        y, down_delta = mlp.forward_lora(h, lora, s)
        return y, residual, down_delta

    def _shrinks(self, x: torch.Tensor, qkv: bool) -> bool:
        """Whether the norm before the QKV (``qkv``) or gate/up group shrinks ``x``'s rows
        for it (``shrinks_in_norm``; the QKV group's segment ends in the ROPE_KV work)."""
        return shrinks_in_norm(x) and (not qkv or self.self_attn.rope_kv_in_kernel(x))


def _draw_linear(linear: nn.Linear, generator: torch.Generator | None) -> None:
    """``nn.Linear.reset_parameters``, drawing from ``generator``."""
    nn.init.kaiming_uniform_(linear.weight, a=math.sqrt(5), generator=generator)
    if linear.bias is not None:
        fan_in = linear.weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(linear.bias, -bound, bound, generator=generator)


class DecoderModel(nn.Module):
    """``forward(input_ids, positions) -> hidden states``; ``compute_logits(hidden)``.

    Guarantees: the forward pass allocates only through PyTorch ops whose shapes depend
    on the token count alone, performs no host-device synchronisation (with a graph-safe
    attention backend), and writes each token's K/V to its slot before attending.
    """

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel | None = None,
        kernels: KernelOptions | None = None,
        max_positions: int | None = None,
        lora: LoraShape | None = None,
    ) -> None:
        """``max_positions``: a bound on every position the model will run at (the
        engine's ``max_model_len``). With it, the cos and sin of each position are made
        once, when the model reaches its device, and a step looks its rows up: one kernel
        instead of seven (cast, product, concatenation, cos, sin, two roundings), equal
        bitwise.
        Without it (or for another dtype than the weights'), each step computes them.
        ``lora``: hold that many LoRA adapters (``model.lora``, empty slots; one GPU)."""
        super().__init__()
        tp = tp or TensorParallel()
        if max_positions is not None and max_positions < 1:
            raise ValueError(f"DecoderModel: max_positions must be >= 1, got {max_positions}")
        self.max_positions = max_positions
        self.rope_table: torch.Tensor | None = None  # [max_positions, 2, 1, head_dim]
        self.config = config
        self.tp = tp
        # How its own kernels launch, one object every module that launches one reads
        # (resolve it against the device first: ``KernelOptions.resolved``; an option
        # left unset is held on, ``as_built``).
        self.kernels = kernels = (kernels or KernelOptions()).as_built()
        # Vocabulary-parallel embedding and LM head: rank r holds rows [r * V/tp, ...).
        self.vocab_local = tp.split(config.vocab_size, "vocab_size")
        self.vocab_start = tp.rank * self.vocab_local
        # Drawing the table on the meta device goes through torch._refs, whose import
        # costs seconds, so there it stays unmade (to_empty, then reset_parameters or the
        # checkpoint fills it); on a real device it is drawn as nn.Embedding draws it.
        table = torch.empty(self.vocab_local, config.hidden_size)
        if table.device.type != "meta":
            nn.init.normal_(table)
        self.embed_tokens = nn.Embedding(self.vocab_local, config.hidden_size, _weight=table)
        layers = (DecoderLayer(config, i, tp, kernels) for i in range(config.num_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.lm_head = Linear(config.hidden_size, self.vocab_local, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if lora is not None and tp.group is not None:
            raise ValueError("lora: not with tensor parallelism yet; use one GPU")
        self.lora = LoraWeights(config, lora) if lora is not None else None
        self._join_lora()
        # Row counts at which a step measured faster without PDL (``launches_at``).
        self.no_pdl_rows: frozenset[int] = frozenset()
        # On the device the model is made on (a ``torch.device`` context included).
        inv_freq = rope_inv_freq(config).to(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_table = self._rope_table()

    def _apply(self, fn: Any, recurse: bool = True) -> DecoderModel:
        # Module.to(dtype) would round the RoPE frequencies to bf16, which shifts the
        # angles of late positions by whole radians; keep them float32 like transformers.
        super()._apply(fn, recurse)
        self._join_lora()  # (the conversion made the weights and the slots' A anew)
        if self.config.tie_word_embeddings:
            # A conversion that makes new parameters (to_empty from meta) unties them.
            self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        self.rope_table = self._rope_table()
        return self

    def _join_lora(self) -> None:
        """Each projection's weight and its LoRA slots' A in one buffer (``join``)."""
        if self.lora is None:
            return
        for layer, slots in zip(self.layers, self.lora.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            slots["qkv"].join(attn.qkv_proj)
            slots["o"].join(attn.o_proj)
            slots["gate_up"].join(mlp.gate_up_proj)
            slots["down"].join(mlp.down_proj)

    def _rope_table(self) -> torch.Tensor | None:
        """The RoPE table of ``max_positions`` positions, in the weights' dtype, where the
        frequencies are; None without a bound, or on meta (nothing to compute)."""
        if self.max_positions is None or self.inv_freq.device.type == "meta":
            return None
        return rope_table(self.inv_freq, self.max_positions, self.embed_tokens.weight.dtype)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draws every parameter anew, in place (on whatever device and dtype they are),
        with each module's own initialisation; ties stay tied. The draws come from
        ``generator`` (torch's default one without it), in the order and with the
        distributions of the modules' own ``reset_parameters``, so a generator seeded with
        s draws what ``torch.manual_seed(s)`` then ``reset_parameters()`` draws."""
        for module in self.modules():
            if module is self:
                continue
            if isinstance(module, nn.Linear):
                _draw_linear(module, generator)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, generator=generator)
                module._fill_padding_idx_with_zero()
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()

    @property
    def rope_in_attention(self) -> bool:
        """Whether the attention backend applies RoPE (see ``Attention``)."""
        return self.layers[0].self_attn.rope_in_attention if len(self.layers) else False

    @rope_in_attention.setter
    def rope_in_attention(self, value: bool) -> None:
        for layer in self.layers:
            layer.self_attn.rope_in_attention = value

    @property
    def unfused_rows(self) -> frozenset[int]:
        """Row counts at which the layers run unfused although ``fused_layers`` is on
        (where a measurement found the fused ops slower: ``worker.layer_tuning``); the
        final norm and the LM head then run apart too. Empty by default."""
        return self.layers[0].unfused_rows if len(self.layers) else frozenset()

    @unfused_rows.setter
    def unfused_rows(self, rows: frozenset[int]) -> None:
        for layer in self.layers:
            layer.unfused_rows = frozenset(rows)

    @contextlib.contextmanager
    def unfused_here(self, rows: frozenset[int]) -> Iterator[None]:
        """Inside, this thread's steps run the layers unfused at ``rows`` and fused
        elsewhere, whatever ``unfused_rows`` says; other threads' steps are untouched (a
        layer timing beside them runs its variant without their seeing it)."""
        token = _UNFUSED_HERE.set(frozenset(rows))
        try:
            yield
        finally:
            _UNFUSED_HERE.reset(token)

    def launches_at(self, rows: int) -> contextlib.AbstractContextManager[None]:
        """What a step of ``rows`` rows runs inside, around the model and its sampling:
        its launches without PDL where ``no_pdl_rows`` (a measurement,
        ``worker.layer_tuning``) says so, else as their callers ask. Entered by the
        runner, outside any compiled code (a context variable: ``launch.without_pdl``)."""
        return without_pdl(rows in self.no_pdl_rows)

    def linears(self, lm_head: bool = True) -> list[tuple[Linear, bool]]:
        """Every projection (the layers' and, with ``lm_head``, the LM head's) with
        whether its output goes through SiLU·mul (the gate/up projections): what the
        small-GEMM plans cover."""
        found: list[tuple[Linear, bool]] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            found += [(attn.qkv_proj, False), (attn.o_proj, False)]
            found += [(mlp.gate_up_proj, True), (mlp.down_proj, False)]
        if lm_head:
            found.append((self.lm_head, False))
        return found

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``input_ids`` (each rank looks up its own rows, then a sum)."""
        if self.tp.group is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_local)
        x = self.embed_tokens(torch.where(mine, local, torch.zeros_like(local)))
        x = x * mine[:, None].to(x.dtype)
        return self.tp.all_reduce(x)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None
    ) -> torch.Tensor:
        """Final-norm hidden states; ``num_layers`` runs only the first layers (a
        self-draft: the truncated model with the same final norm and LM head)."""
        x, residual, handed, partial = self._layers(input_ids, positions, num_layers)
        return self._final_norm(x, residual, partial, handed)

    def _final_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        partial: bool,
        handed: RowStats | RowDelta | None = None,
    ) -> torch.Tensor:
        if residual is None:
            return self.norm(x)
        if partial:  # (this rank's part of the last block's output: reduced in the norm)
            return self.norm.reduce_add(x, residual, self.tp)[0]
        delta = handed if isinstance(handed, RowDelta) else None  # (a LoRA step's last)
        return self.norm.add_delta(x, residual, delta)[0]

    def logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``compute_logits(forward(input_ids, positions), out)``: the logits of every
        row. With fused layers the final norm and the LM head are one op
        (``ostinato::norm_linear``), one kernel where the LM head's plan runs the Triton
        GEMM for these rows, its norm from the last layer's row statistics where ready.
        An LM head without a plan (the default) runs the norm kernel, then cuBLAS
        into ``out``."""
        x, residual, stats, partial = self._layers(input_ids, positions, None)
        head, norm = self.lm_head, self.norm
        fused = self.kernels.fused_layers and input_ids.shape[0] not in _unfused(self.unfused_rows)
        if partial or isinstance(stats, RowDelta) or not (fused and head.plan):
            return self.compute_logits(self._final_norm(x, residual, partial, stats), out)
        y, _ = torch.ops.ostinato.norm_linear(
            x, residual, norm.weight, norm.eps, head.weight, head.counters, list(head.plan),
            False, self.kernels.pdl, *RowStats.args(stats),
        )  # fmt: skip
        return all_gather_last_dim(y, self.tp.group)

    def _layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, RowStats | RowDelta | None, bool]:
        """The first ``num_layers`` layers (all with None): the last one's output, the
        residual sum before it (None with no layer run), what it hands the final norm
        (its row statistics, or a LoRA step's delta), and whether
        that output is this rank's partial sum (an unfused layer under tensor
        parallelism: the final norm reduces it)."""
        x, cos, sin = self._inputs(input_ids, positions)
        residual, stats = None, None
        lora = None
        if self.lora is not None and lora_step():
            lora = self.lora.rows(x)
        run = self.layers[:num_layers]
        for layer in run:
            x, residual, stats = layer(x, residual, cos, sin, stats, lora)
        unfused = len(run) > 0 and not run[-1].fuses(x.shape[0], lora)
        return x, residual, stats, unfused and self.tp.group is not None

    def _inputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``embed(input_ids)`` and ``rope(positions, dtype)``: eagerly, with the table in
        the embeddings' dtype, both from one op (``LaunchRules.embed_rope``; under tensor
        parallelism this rank's rows of its vocabulary shard, zeros for the others, then
        the sum); the same bits either way, since both only copy rows."""
        table, weight = self.rope_table, self.embed_tokens.weight
        one_op = rules().embed_rope and not torch.compiler.is_compiling()
        if not one_op or table is None or table.dtype != weight.dtype:
            x = self.embed(input_ids)
            return (x, *self.rope(positions, x.dtype))
        pdl, start = self.kernels.pdl, self.vocab_start  # (0 on one rank)
        x, rows = torch.ops.ostinato.embed_rope(input_ids, positions, weight, table, pdl, start)
        if self.tp.group is not None:
            x = self.tp.all_reduce(x)
        return x, rows[:, 0], rows[:, 1]

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[n, 1, head_dim]`` in ``dtype`` for the rows at ``positions``
        (``rope.rope_cos_sin``'s values); from the table, strided views of one lookup,
        where the model has one in ``dtype``. A padding row's position -1 reads the last
        row there, a value nothing uses."""
        table = self.rope_table
        if table is None or table.dtype != dtype:
            return rope_cos_sin(positions, self.inv_freq, dtype)
        rows = table[positions]
        return rows[:, 0], rows[:, 1]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the whole vocabulary for hidden-state rows, in the LM head's dtype
        (the model's), on one rank written into ``out`` where cuBLAS computes them
        (``Linear.forward_into``). They are not cast to float32 here: a greedy step only
        takes their argmax, which the cast cannot change, and at 128 rows of a 128k
        vocabulary the cast and the copy of float32 logits into the decode graph's static
        output cost the step more than its argmax. ``sample`` and ``verify`` cast what
        they use."""
        if out is not None and self.tp.group is None:
            return self.lm_head.forward_into(hidden, out)
        return all_gather_last_dim(self.lm_head(hidden), self.tp.group)
