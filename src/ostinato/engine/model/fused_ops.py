"""A decoder layer's two norm-then-projection pairs as custom ops, opaque to torch.compile:

- ``ostinato::norm_qkv``: the input RMSNorm (with the residual add), the QKV projection,
  the Qwen3 head norms, and the K/V cache write with RoPE on the keys. Writes the query
  heads, unrotated (the attention op rotates them), and the residual sum into buffers
  the caller made. A splitting op of the piecewise backend, as attention is: its
  ``layer`` argument would make every layer's piece a graph of its own. The compiled
  model does not call it (``DecoderLayer.forward``): eagerly between the graphs, its
  unfused norm and projection would cost every prefill their launches.
- ``ostinato::norm_linear``: an RMSNorm (with the residual add) and the projection after
  it: with ``swiglu`` the post-attention norm, the gate/up projection and SiLU·mul;
  without, the final norm and the LM head. Returns the output and the residual sum.

With ``stats`` each takes the norm's sums of squares from the row statistics of
``x + residual`` that the projection before it stored (``Linear.forward_stats``), where
that projection's plan (``stats_plan``) ran the kernel for these rows
(``linear.kernel_rows``, the one predicate of both sides), instead of from a pass over
the rows before its K loop.

Each is one kernel (``small_gemm``'s NORM prologue with its ROPE_KV, SWIGLU or PLAIN epilogue)
where that kernel can run: on CUDA, 16-bit weights, at most ``MAX_ROWS`` rows, a plan
entry for that row count (``Linear.use_plan``: the runner gives one to every projection
of a fused model), and for ``norm_qkv`` the Triton attention backend's cache layout.
Elsewhere each runs the unfused ops in sequence, the ones the layer ran before fusion:
the same arithmetic, and on the CPU the same bits. The forward context supplies the
step's cache, slots and backend, as it does to ``ostinato::attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ostinato.context import get_forward_context
from ostinato.engine.kernels.gemm_launch import CONFIGS, GemmConfig, rope_config, rope_head_dim
from ostinato.engine.kernels.launch_rules import rules
from ostinato.engine.model.attention import TritonAttention
from ostinato.engine.model.linear import kernel_rows
from ostinato.engine.model.norm_op import check_residual
from ostinato.engine.model.rope import apply_rope

if TYPE_CHECKING:
    from ostinato.engine.kernels.small_gemm import NormPrologue, RopeKV  # (Triton: CUDA only)

_lib = torch.library.Library("ostinato", "FRAGMENT")
_lib.define(
    "norm_qkv(Tensor x, Tensor? residual, Tensor norm_weight, float eps, Tensor weight, "
    "Tensor? bias, Tensor counters, int[] plan, Tensor? q_norm, Tensor? k_norm, "
    "Tensor cos, Tensor sin, int layer, int q_heads, int kv_heads, Tensor(a!) qkv_out, "
    "Tensor(b!) total_out, bool pdl=False, Tensor? stats=None, int[] stats_plan=[]) -> ()"
)
_lib.define(
    "norm_linear(Tensor x, Tensor? residual, Tensor norm_weight, float eps, Tensor weight, "
    "Tensor counters, int[] plan, bool swiglu, bool pdl=False, Tensor? stats=None, "
    "int[] stats_plan=[]) -> (Tensor, Tensor)"
)


def _fuses_qkv(
    x: torch.Tensor, weight: torch.Tensor, plan: list[int], backend: object, head_dim: int
) -> bool:
    """Whether ``norm_qkv`` runs as one kernel: a planned row count, the Triton backend's
    cache layout with RoPE applied at the cache write, and heads the ROPE_KV epilogue
    takes."""
    rope_write = isinstance(backend, TritonAttention) and backend.applies_rope
    return bool(kernel_rows(x, weight, plan)) and rope_write and rope_head_dim(head_dim)


def _norm_prologue(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    total: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
) -> tuple[object, torch.Tensor]:
    """The kernel's ``NormPrologue`` (with ``stats``, which must be ready) and the
    residual sum it fills (into ``total`` when given; empty without a residual)."""
    from ostinato.engine.kernels.small_gemm import NormPrologue

    if residual is None:
        return NormPrologue(weight, eps, stats=stats), x.new_empty(0)
    check_residual(x, residual)
    if total is None:
        total = torch.empty_like(x, memory_format=torch.contiguous_format)
    return NormPrologue(weight, eps, residual.contiguous(), total, stats), total


def _ready_stats(
    x: torch.Tensor, weight: torch.Tensor, stats: torch.Tensor | None, stats_plan: list[int]
) -> torch.Tensor | None:
    """``stats`` where the projection that made ``x`` stored them for its rows (its plan
    ran the kernel: ``kernel_rows``, on rows and weights of this op's dtype), else None."""
    return stats if stats is not None and kernel_rows(x, weight, stats_plan) else None


def _norm_into(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    pdl: bool,
    total: torch.Tensor,
) -> torch.Tensor:
    """The norm of ``x (+ residual)``, the sum stored to ``total``: the unfused ops (on
    CUDA the one norm kernel, writing the sum where it is wanted)."""
    if residual is None:
        return torch.ops.ostinato.rms_norm(x, weight, eps, pdl)
    if not x.is_cuda:
        h, t = torch.ops.ostinato.add_rms_norm(x, residual, weight, eps, pdl)
        total.copy_(t)
        return h
    from ostinato.engine.kernels.rms_norm import rms_norm_rows

    check_residual(x, residual)
    h = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    rms_norm_rows(x, residual, weight, eps, h, total, pdl)
    return h


@dataclass(frozen=True)
class HeadsOf:
    """A layer's attention heads as the ROPE_KV epilogue takes them: the layer (its
    cache), the head counts on this rank, and the Qwen3 head norms' weights and eps."""

    layer: int
    q_heads: int
    kv_heads: int
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 0.0


def rope_kv(heads: HeadsOf, cos: torch.Tensor, sin: torch.Tensor) -> RopeKV:
    """The ROPE_KV epilogue's operands for layer ``heads.layer`` in the step being run
    (its cache and slots from the forward context)."""
    from ostinato.engine.kernels.small_gemm import RopeKV

    step = get_forward_context().attn_metadata
    k_cache, v_cache = step.cache.k[heads.layer], step.cache.v[heads.layer]
    return RopeKV(
        cos, sin, k_cache, v_cache, step.metadata.slot_mapping, heads.q_heads, heads.kv_heads,
        heads.q_norm, heads.k_norm, heads.eps,
    )  # fmt: skip


def _rope_kv_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    heads: HeadsOf,
    cos: torch.Tensor,
    sin: torch.Tensor,
    prologue: NormPrologue | None,
    pdl: bool,
    out: torch.Tensor,
    config: GemmConfig | None = None,
) -> None:
    """The one kernel of ``norm_qkv`` (``prologue``: its norm, or None for rows already
    normed): the projection, the head norms, the rotated keys and the values into the
    step's cache, the query heads (unrotated) into ``out``; launched as ``config`` says,
    by default as ``rope_config`` does."""
    from ostinato.engine.kernels.launch import num_sms
    from ostinato.engine.kernels.small_gemm import qkv_rope_kv

    rope = rope_kv(heads, cos, sin)
    config = config or rope_config(
        heads.q_heads + 2 * heads.kv_heads, rope.k_cache.shape[-1], x.shape[1], num_sms(x.device),
        x.shape[0], heads.q_norm is not None, weight.numel() * weight.element_size(),
    )  # fmt: skip
    qkv_rope_kv(x, weight, bias, counters, config, rope, prologue, pdl, out=out)


def qkv_rope_kv_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    plan: list[int],
    heads: HeadsOf,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pdl: bool = False,
) -> torch.Tensor | None:
    """``norm_qkv``'s kernel for rows ``x`` that are already normed (an unfused layer's,
    eagerly: under tensor parallelism the norm ran inside the all-reduce), where it runs
    as one kernel (``_fuses_qkv``): the keys (rotated) and the values written to the
    layer's cache, and the query heads (QK-normed, unrotated) returned, ``[n, q_heads *
    d]``, for ``ostinato::attention`` without k and v. Elsewhere None, nothing launched."""
    step = get_forward_context().attn_metadata
    if step is None:
        return None
    d = step.cache.k[heads.layer].shape[-1]
    if not _fuses_qkv(x, weight, plan, step.backend, d):
        return None
    q = torch.empty((x.shape[0], heads.q_heads * d), dtype=x.dtype, device=x.device)
    config = _planned(x, weight, plan, heads)
    _rope_kv_kernel(x, weight, bias, counters, heads, cos, sin, None, pdl, q, config)
    return q


def _planned(
    x: torch.Tensor, weight: torch.Tensor, plan: list[int], heads: HeadsOf
) -> GemmConfig | None:
    """An unfused layer's ROPE_KV launch where ``LaunchRules.qkv_on_plan``: the projection's
    plan entry for these rows (a K loop's column tile becomes the half head), but for
    head norms on a resident or shared-memory one, which needs a program per head; None
    (``rope_config``'s rule) there and without the rule."""
    choice = kernel_rows(x, weight, plan)
    if not (rules().qkv_on_plan and choice):
        return None
    config = CONFIGS[choice - 1]
    return None if heads.q_norm is not None and (config.resident or config.smem) else config


def norm_qkv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    plan: list[int],
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer: int,
    q_heads: int,
    kv_heads: int,
    qkv_out: torch.Tensor,
    total_out: torch.Tensor,
    pdl: bool = False,
    stats: torch.Tensor | None = None,
    stats_plan: list[int] | None = None,
) -> None:
    """Writes the step's keys (rotated) and values to layer ``layer``'s cache, the query
    heads (QK-normed, unrotated) to the first ``q_heads * d`` columns of ``qkv_out``
    (``[n, (q_heads + 2 kv_heads) * d]``; the rest is scratch) and ``x + residual`` to
    ``total_out`` (unused without a residual). The outputs are the caller's buffers, as
    a splitting op's must be (graphs hold them); no compiled model calls it today."""
    # Over 60 lines: 22 are the op's signature (a splitting op's schema is its arguments);
    # the body is the fused path and the unfused one, about 20 lines each.
    step = get_forward_context().attn_metadata
    k_cache, v_cache = step.cache.k[layer], step.cache.v[layer]
    slots = step.metadata.slot_mapping
    backend = step.backend
    if _fuses_qkv(x, weight, plan, backend, k_cache.shape[-1]):
        heads = HeadsOf(layer, q_heads, kv_heads, q_norm, k_norm, eps)
        ready = _ready_stats(x, weight, stats, stats_plan or [])
        prologue, _ = _norm_prologue(x, residual, norm_weight, eps, total_out, ready)
        # (``rope_config``'s launch, a program per head: on the projection's plan entry
        # the 1.5 B shape's fused step was 5% slower at 8 rows, ``LaunchRules.qkv_on_plan``)
        q = qkv_out[:, : q_heads * k_cache.shape[-1]]
        _rope_kv_kernel(x, weight, bias, counters, heads, cos, sin, prologue, pdl, q)
        return
    h = _norm_into(x, residual, norm_weight, eps, pdl, total_out)
    if bias is None:
        torch.mm(h, weight.t(), out=qkv_out)
    else:
        torch.addmm(bias, h, weight.t(), out=qkv_out)  # what F.linear with a bias runs
    d = weight.shape[0] // (q_heads + 2 * kv_heads)
    n = x.shape[0]
    q, k, v = (
        t.view(n, -1, d) for t in qkv_out.split([q_heads * d, kv_heads * d, kv_heads * d], -1)
    )
    if q_norm is not None and k_norm is not None:
        q.copy_(torch.ops.ostinato.rms_norm(q, q_norm, eps, pdl))
        k = torch.ops.ostinato.rms_norm(k, k_norm, eps, pdl)
    rope: tuple[torch.Tensor, torch.Tensor] | None = (cos, sin)
    if not backend.applies_rope:
        k, rope = apply_rope(k, cos, sin), None
    backend.write_kv(k, v, k_cache, v_cache, slots, rope)


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    counters: torch.Tensor,
    plan: list[int],
    swiglu: bool,
    pdl: bool = False,
    stats: torch.Tensor | None = None,
    stats_plan: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the projection of ``rms_norm(x + residual)``, with ``swiglu`` ``silu(g) * u`` of
    its halves ``[g | u]``; ``x + residual``, empty without a residual)."""
    choice = kernel_rows(x, weight, plan)
    if choice:
        from ostinato.engine.kernels import small_gemm as triton_gemm

        ready = _ready_stats(x, weight, stats, stats_plan or [])
        prologue, total = _norm_prologue(x, residual, norm_weight, eps, stats=ready)
        config = triton_gemm.CONFIGS[choice - 1]
        out = triton_gemm.small_gemm(x, weight, None, counters, config, swiglu, pdl, prologue)
        return out, total
    if residual is None:
        h, total = torch.ops.ostinato.rms_norm(x, norm_weight, eps, pdl), x.new_empty(0)
    else:
        h, total = torch.ops.ostinato.add_rms_norm(x, residual, norm_weight, eps, pdl)
    y = F.linear(h, weight)
    return (torch.ops.ostinato.silu_mul(y, pdl) if swiglu else y), total


_lib.impl("norm_qkv", norm_qkv, "CompositeExplicitAutograd")
_lib.impl("norm_linear", norm_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("ostinato::norm_qkv", lib=_lib)
def _(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    plan: list[int],
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer: int,
    q_heads: int,
    kv_heads: int,
    qkv_out: torch.Tensor,
    total_out: torch.Tensor,
    pdl: bool = False,
    stats: torch.Tensor | None = None,
    stats_plan: list[int] | None = None,
) -> None:
    return None


@torch.library.register_fake("ostinato::norm_linear", lib=_lib)
def _(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    counters: torch.Tensor,
    plan: list[int],
    swiglu: bool,
    pdl: bool = False,
    stats: torch.Tensor | None = None,
    stats_plan: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = x.new_empty((x.shape[0], n), dtype=weight.dtype)
    return out, torch.empty_like(x) if residual is not None else x.new_empty(0)
