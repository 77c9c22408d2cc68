"""Every decoder layer of a step of at most ``MAX_ROWS`` rows in one persistent kernel.

One program per SM walks all layers; between the stages of a layer every program waits
at a grid barrier (an atomic counter in global memory), so the step is one launch and
about five barriers per layer instead of six kernels per layer. The stages are the
per-layer kernels' own code (``small_gemm``'s tile loop, norm prologue and RoPE/K-V
epilogue; ``paged_attention``'s query load, online softmax and split merge), so the
arithmetic and its rounding are theirs:

1. norm (+ residual add) -> QKV projection -> Qwen3 head norms -> RoPE on K -> K/V to the
   cache; queries (unrotated) to ``q``; one program per head.
2. attention over the paged cache, each token's keys split over programs; the last
   split of a (token, KV head) to finish merges the partials (a counter per pair).
3. output projection -> ``o``.
4. norm (+ residual add) -> gate/up projection -> SiLU·mul -> ``act``.
5. down projection -> ``mlp``.

The residual stream alternates between ``res[1]`` (after stage 1) and ``res[0]`` (after
stage 4); the caller puts the embeddings in ``res[1]`` and applies the final norm to
``mlp + res[0]``. A grid barrier needs every program resident at once: one program per
SM, and nothing else holding SMs for good (a captured graph's earlier kernels finish).
Weights and caches are reached through tables of their addresses, one entry per layer,
so the layers' tensors stay where the model put them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.attention_launch import BLOCK_N, MAX_SPLITS
from ostinato.engine.kernels.gemm_launch import MAX_ROWS
from ostinato.engine.kernels.paged_attention import (
    _attend,
    _key_range,
    _merged,
    _query,
    _softmax_start,
)
from ostinato.engine.kernels.small_gemm import (
    LINE,
    NORM_K,
    _dot_tile,
    _prefetch_l2,
    _rope_inputs,
    _rope_kv_epilogue,
    _row_rstd,
)

BLOCK_K = 256  # columns of x per step of the tile loops: few, long steps (latency-bound)
BLOCK_N_PLAIN = 16  # output columns per program of the O and down projections
_LINE = tl.constexpr(LINE)  # 16-bit elements per cache line, readable inside the kernel


@triton.jit
def _grid_sync(sync_ptr, target):
    """Waits until the grid's programs have arrived ``target`` times in all: every
    thread's writes before it are visible to every program after it (cooperative groups'
    grid sync: a CTA barrier, a release add, an acquire spin, a CTA barrier)."""
    tl.debug_barrier()
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    # Polled with plain volatile loads (an atomic per poll from every SM would queue at
    # the counter's L2 slice), then one acquire to order what follows after the arrivals.
    while tl.load(sync_ptr, volatile=True) < target:
        pass
    tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _grid_exit(sync_ptr):
    """Counts this program out of the grid; the last one out zeroes the barrier's and
    its own counter (``sync_ptr[0:2]``) for the next launch. Call it after the program's
    last ``_grid_sync``: every program is past its last wait by then."""
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.atomic_xchg(sync_ptr, 0)
        tl.atomic_xchg(sync_ptr + 1, 0)


@triton.jit
def _prefetch_rows(w_ptr, rn, N, K, LINES: tl.constexpr):
    """Starts reading rows ``rn`` of ``W [N, K]`` into L2 (one prefetch per 128-byte
    line; ``LINES`` >= K / 64, a power of two), waiting for nothing."""
    lines = tl.minimum(tl.arange(0, LINES) * _LINE, K - 1)
    _prefetch_l2(w_ptr + tl.minimum(rn, N - 1)[:, None] * K + lines[None, :])


@triton.jit
def _prefetch_layer(
    layer, pid, nprog, like, qkv_tab, o_tab, up_tab, down_tab, LAYERS: tl.constexpr,
    H: tl.constexpr, INTER: tl.constexpr, QS: tl.constexpr, HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N_UP: tl.constexpr, BLOCK_N_PLAIN: tl.constexpr,
    LINES_H: tl.constexpr, LINES_QS: tl.constexpr, LINES_I: tl.constexpr,
):  # fmt: skip
    """Starts reading into L2 the weight rows this program will multiply in layer
    ``layer``'s O, gate/up and down stages and the next layer's QKV stage: weights do
    not wait for activations, so they stream in while attention and the barriers run."""
    o, up, down = _at(o_tab, layer, like), _at(up_tab, layer, like), _at(down_tab, layer, like)
    for t in range(pid, tl.cdiv(H, BLOCK_N_PLAIN), nprog):
        rn = t * BLOCK_N_PLAIN + tl.arange(0, BLOCK_N_PLAIN)
        _prefetch_rows(o, rn, H, QS, LINES_QS)
        _prefetch_rows(down, rn, H, INTER, LINES_I)
    for t in range(pid, tl.cdiv(INTER, BLOCK_N_UP), nprog):
        rn = t * BLOCK_N_UP + tl.arange(0, BLOCK_N_UP)
        _prefetch_rows(up, rn, 2 * INTER, H, LINES_H)
        _prefetch_rows(up, rn + INTER, 2 * INTER, H, LINES_H)
    if layer + 1 < LAYERS:
        qkv = _at(qkv_tab, layer + 1, like)
        for head in range(pid, HEADS, nprog):
            rn = head * HEAD_DIM + tl.arange(0, HEAD_DIM)
            _prefetch_rows(qkv, rn, HEADS * HEAD_DIM, H, LINES_H)


@triton.jit
def _at(table_ptr, layer, like):
    """Layer ``layer``'s tensor from an address table, as a pointer to ``like``'s dtype."""
    return tl.load(table_ptr + layer).to(tl.pointer_type(like.dtype.element_ty))


@triton.jit
def _qkv_stage(
    layer, pid, nprog, x_ptr, r_ptr, total_ptr, ln_tab, w_tab, b_tab, qn_tab, kn_tab,
    kc_tab, vc_tab, q_ptr, cos_ptr, sin_ptr, stride_rt, slot_ptr, stride_cs, stride_ch, M,
    eps, ADD: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
    H: tl.constexpr, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NORM_K: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = HEAD_DIM // 2
    HEADS: tl.constexpr = Q_HEADS + 2 * KV_HEADS
    nw, w = _at(ln_tab, layer, x_ptr), _at(w_tab, layer, x_ptr)
    kc, vc = _at(kc_tab, layer, x_ptr), _at(vc_tab, layer, x_ptr)
    qn, kn = _at(qn_tab, layer, x_ptr), _at(kn_tab, layer, x_ptr)
    rm = tl.arange(0, BLOCK_M)
    for head in range(pid, HEADS, nprog):
        rstd = _row_rstd(
            x_ptr, r_ptr, total_ptr, M, H, H, H, H, eps, head == 0, ADD, BLOCK_M, NORM_K
        )
        rn = head * HEAD_DIM + tl.arange(0, HALF)
        a, b = _dot_tile(
            x_ptr, r_ptr, x_ptr, nw, w, rstd, rn, 0, H, H, M, HEADS * HEAD_DIM, H, H, H, H,
            HALF, False, True, ADD, False, True, BLOCK_M, HALF, BLOCK_K,
        )  # fmt: skip
        if HAS_BIAS:
            bias = _at(b_tab, layer, x_ptr)
            a += tl.load(bias + rn).to(tl.float32)[None, :]
            b += tl.load(bias + rn + HALF).to(tl.float32)[None, :]
        a = a.to(x_ptr.dtype.element_ty).to(tl.float32)  # the projection, as stored unfused
        b = b.to(x_ptr.dtype.element_ty).to(tl.float32)
        ca, cb, sa, sb, slot = _rope_inputs(
            rm, M, head, 0, cos_ptr, sin_ptr, stride_rt, slot_ptr, Q_HEADS, KV_HEADS, HALF,
            HALF,
        )  # fmt: skip
        _rope_kv_epilogue(
            a, b, rm, M, head, 0, q_ptr, Q_HEADS * HEAD_DIM, ca, cb, sa, sb, slot, kc, vc,
            stride_cs, stride_ch, qn, kn, eps, Q_HEADS, KV_HEADS, QK_NORM, HALF, HALF,
        )  # fmt: skip


@triton.jit
def _attention_stage(
    layer, pid, nprog, q_ptr, out_ptr, part_ptr, m_ptr, l_ptr, count_ptr, pos_ptr, req_ptr,
    tables_ptr, kc_tab, vc_tab, cos_ptr, sin_ptr, stride_rt, scale, stride_kb, stride_ks,
    stride_kh, stride_tr, M, splits,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_PAD: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):  # fmt: skip
    GROUP: tl.constexpr = Q_HEADS // KV_HEADS
    kc, vc = _at(kc_tab, layer, q_ptr), _at(vc_tab, layer, q_ptr)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    for item in range(pid, M * KV_HEADS * splits, nprog):
        split = item % splits
        pair = item // splits  # tok * KV_HEADS + kvh
        tok, kvh = pair // KV_HEADS, pair % KV_HEADS
        pos = tl.load(pos_ptr + tok).to(tl.int32)
        req = tl.load(req_ptr + tok).to(tl.int32)
        lo, hi = _key_range(pos, splits, split, BLOCK_N)
        heads = kvh * GROUP + g
        q = _query(
            q_ptr, tok, heads, d, g_mask, cos_ptr, sin_ptr, stride_rt, Q_HEADS * HEAD_DIM,
            HEAD_DIM, HEAD_DIM, True,
        )  # fmt: skip
        m, l_sum, acc = _softmax_start(GROUP_PAD, HEAD_DIM)
        m, l_sum, acc = _attend(
            q, m, l_sum, acc, kc, vc, tables_ptr, req, kvh, lo, hi, scale, stride_kb,
            stride_ks, stride_kh, stride_tr, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
        )  # fmt: skip
        # Partials laid out [token, head, MAX_SPLITS, (d)].
        row = (tok * Q_HEADS + heads) * MAX_SPLITS + split
        tl.store(m_ptr + row, m, mask=g_mask)
        tl.store(l_ptr + row, l_sum, mask=g_mask)
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None])
        # acq_rel: this partial is visible before the count; the last to count sees all.
        if tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu") == splits - 1:
            for i in range(GROUP):
                head = kvh * GROUP + i
                first = (tok * Q_HEADS + head) * MAX_SPLITS
                out = _merged(part_ptr, m_ptr, l_ptr, first, splits, HEAD_DIM, MAX_SPLITS, ".cg")
                at = out_ptr + tok * Q_HEADS * HEAD_DIM + head * HEAD_DIM + d
                tl.store(at, out.to(out_ptr.dtype.element_ty))
            tl.atomic_xchg(count_ptr + pair, 0)


@triton.jit
def _plain_stage(
    layer, pid, nprog, x_ptr, w_tab, out_ptr, M, K: tl.constexpr, N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out = x @ W.T`` (``[M, K]`` by ``[N, K]``), BLOCK_N columns per program."""
    w = _at(w_tab, layer, x_ptr)
    rm = tl.arange(0, BLOCK_M)
    for t in range(pid, tl.cdiv(N, BLOCK_N), nprog):
        rn = t * BLOCK_N + tl.arange(0, BLOCK_N)
        acc, _ = _dot_tile(
            x_ptr, x_ptr, x_ptr, x_ptr, w, tl.zeros((BLOCK_M,), tl.float32), rn, 0, K, K, M,
            N, K, K, K, K, 0, False, False, False, False, False, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask)


@triton.jit
def _swiglu_stage(
    layer, pid, nprog, x_ptr, r_ptr, total_ptr, ln_tab, w_tab, out_ptr, M, eps,
    H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM_K: tl.constexpr,
):  # fmt: skip
    """``out = silu(g) * u`` of ``[g | u] = norm(x + r) @ W.T``; ``total = x + r``."""
    nw, w = _at(ln_tab, layer, x_ptr), _at(w_tab, layer, x_ptr)
    dtype = x_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    for t in range(pid, tl.cdiv(INTER, BLOCK_N), nprog):
        rstd = _row_rstd(x_ptr, r_ptr, total_ptr, M, H, H, H, H, eps, t == 0, True, BLOCK_M, NORM_K)
        rn = t * BLOCK_N + tl.arange(0, BLOCK_N)
        g, u = _dot_tile(
            x_ptr, r_ptr, x_ptr, nw, w, rstd, rn, 0, H, H, M, INTER, H, H, H, H, INTER, False,
            True, True, False, True, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        g = g.to(dtype).to(tl.float32)
        y = g * tl.sigmoid(g) * u.to(dtype).to(tl.float32)
        mask = (rm[:, None] < M) & (rn[None, :] < INTER)
        tl.store(out_ptr + rm[:, None] * INTER + rn[None, :], y.to(dtype), mask)


@triton.jit(do_not_specialize=["M", "splits"])
def _decode_layers_kernel(
    res_ptr, mlp_ptr, q_ptr, attn_ptr, o_ptr, act_ptr, part_ptr, m_ptr, l_ptr, sync_ptr,
    ln1_tab, qkv_tab, qkv_b_tab, qn_tab, kn_tab, o_tab, ln2_tab, up_tab, down_tab,
    kc_tab, vc_tab, cos_ptr, sin_ptr, pos_ptr, req_ptr, slot_ptr, tables_ptr,
    M, splits, eps, scale, stride_rt, stride_kb, stride_ks, stride_kh, stride_tr,
    LAYERS: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM_K: tl.constexpr, BLOCK_N_UP: tl.constexpr,
    BLOCK_N_PLAIN: tl.constexpr, BLOCK_N_ATT: tl.constexpr, GROUP_PAD: tl.constexpr,
    MAX_SPLITS: tl.constexpr, LINES_H: tl.constexpr, LINES_QS: tl.constexpr,
    LINES_I: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    res0 = res_ptr
    res1 = res_ptr + BLOCK_M * H
    count_ptr = sync_ptr + 2  # the attention merge counters
    QS: tl.constexpr = Q_HEADS * HEAD_DIM
    stride_cs: tl.constexpr = KV_HEADS * HEAD_DIM
    # Layer 0's input is the embeddings in res1: no residual to add, none to store.
    _qkv_stage(
        0, pid, nprog, res1, res1, res1, ln1_tab, qkv_tab, qkv_b_tab, qn_tab, kn_tab,
        kc_tab, vc_tab, q_ptr, cos_ptr, sin_ptr, stride_rt, slot_ptr, stride_cs, HEAD_DIM,
        M, eps, False, HAS_BIAS, QK_NORM, H, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_M, BLOCK_K,
        NORM_K,
    )  # fmt: skip
    phase = 1
    for layer in range(LAYERS):
        if PREFETCH:
            _prefetch_layer(
                layer, pid, nprog, res_ptr, qkv_tab, o_tab, up_tab, down_tab, LAYERS, H, INTER,
                QS, Q_HEADS + 2 * KV_HEADS, HEAD_DIM, BLOCK_N_UP, BLOCK_N_PLAIN, LINES_H,
                LINES_QS, LINES_I,
            )  # fmt: skip
        _grid_sync(sync_ptr, phase * nprog)
        _attention_stage(
            layer, pid, nprog, q_ptr, attn_ptr, part_ptr, m_ptr, l_ptr, count_ptr, pos_ptr,
            req_ptr, tables_ptr, kc_tab, vc_tab, cos_ptr, sin_ptr, stride_rt, scale,
            stride_kb, stride_ks, stride_kh, stride_tr, M, splits, Q_HEADS, KV_HEADS,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N_ATT, GROUP_PAD, MAX_SPLITS,
        )  # fmt: skip
        _grid_sync(sync_ptr, (phase + 1) * nprog)
        _plain_stage(
            layer, pid, nprog, attn_ptr, o_tab, o_ptr, M, QS, H, BLOCK_M, BLOCK_N_PLAIN, BLOCK_K
        )
        _grid_sync(sync_ptr, (phase + 2) * nprog)
        _swiglu_stage(
            layer, pid, nprog, o_ptr, res1, res0, ln2_tab, up_tab, act_ptr, M, eps, H, INTER,
            BLOCK_M, BLOCK_N_UP, BLOCK_K, NORM_K,
        )  # fmt: skip
        _grid_sync(sync_ptr, (phase + 3) * nprog)
        _plain_stage(
            layer, pid, nprog, act_ptr, down_tab, mlp_ptr, M, INTER, H, BLOCK_M,
            BLOCK_N_PLAIN, BLOCK_K,
        )  # fmt: skip
        phase += 4
        if layer + 1 < LAYERS:
            _grid_sync(sync_ptr, phase * nprog)
            _qkv_stage(
                layer + 1, pid, nprog, mlp_ptr, res0, res1, ln1_tab, qkv_tab, qkv_b_tab,
                qn_tab, kn_tab, kc_tab, vc_tab, q_ptr, cos_ptr, sin_ptr, stride_rt, slot_ptr,
                stride_cs, HEAD_DIM, M, eps, True, HAS_BIAS, QK_NORM, H, Q_HEADS, KV_HEADS,
                HEAD_DIM, BLOCK_M, BLOCK_K, NORM_K,
            )  # fmt: skip
            phase += 1
    _grid_exit(sync_ptr)


@dataclass(frozen=True)
class StackShape:
    """What the kernel is compiled for: the model's dimensions and the cache page size."""

    layers: int
    hidden: int
    inter: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    eps: float
    qkv_bias: bool
    qk_norm: bool


@dataclass(frozen=True)
class LayerTables:
    """Per-layer addresses (``int64 [layers]`` on the device) of the input norm weight,
    QKV weight and bias, Qwen3 head norms, O weight, post-attention norm weight, gate/up
    and down weights, and the K and V caches. Missing tensors (a bias, head norms) are
    the QKV weight's address, never read."""

    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


class DecodeScratch:
    """The kernel's persistent buffers for one stack (fixed addresses: graphs hold them).
    ``res`` and ``mlp`` are the caller's input and output."""

    def __init__(self, shape: StackShape, dtype: torch.dtype, device: torch.device) -> None:
        rows, qs = MAX_ROWS, shape.q_heads * shape.head_dim
        f32 = torch.float32
        self.res = torch.zeros((2, rows, shape.hidden), dtype=dtype, device=device)  # [2, 16, H]
        self.mlp = torch.zeros((rows, shape.hidden), dtype=dtype, device=device)  # [16, H]
        self.q = torch.zeros((rows, qs), dtype=dtype, device=device)  # [16, q_heads * d]
        self.attn = torch.zeros((rows, qs), dtype=dtype, device=device)  # [16, q_heads * d]
        self.o = torch.zeros((rows, shape.hidden), dtype=dtype, device=device)  # [16, H]
        self.act = torch.zeros((rows, shape.inter), dtype=dtype, device=device)  # [16, I]
        partial = (rows, shape.q_heads, MAX_SPLITS)
        self.part = torch.zeros((*partial, shape.head_dim), dtype=f32, device=device)
        self.m = torch.zeros(partial, dtype=f32, device=device)  # [16, q_heads, MAX_SPLITS]
        self.l_sum = torch.zeros(partial, dtype=f32, device=device)
        # [barrier, exit, one merge counter per (row, KV head)]: zero between launches.
        self.sync = torch.zeros(2 + rows * shape.kv_heads, dtype=torch.int32, device=device)


def _lines(k: int) -> int:
    """Cache lines of a ``k``-column 16-bit row, rounded up to a power of two."""
    return triton.next_power_of_2(triton.cdiv(k, LINE))


def _up_block_n(inter: int, programs: int) -> int:
    """Gate/up columns per program: 16, doubled while the tiles outnumber the programs."""
    block_n = 16
    while block_n < 128 and triton.cdiv(inter, block_n) > programs:
        block_n *= 2
    return block_n


def decode_layers(
    n: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    token_req: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    shape: StackShape,
    tables: LayerTables,
    scratch: DecodeScratch,
    programs: int,
) -> None:
    """Runs every layer over rows ``0..n`` (``n <= MAX_ROWS``) of ``scratch.res[1]`` (the
    embeddings), leaving the last layer's output in ``scratch.mlp`` and the residual sum
    before it in ``scratch.res[0]``; writes each row's K/V at its slot. ``programs``: at
    most as many as can be resident at once (the SM count)."""
    if not 0 < n <= MAX_ROWS:
        raise ValueError(f"decode_layers: 1 to {MAX_ROWS} rows, got {n}")
    splits = max(1, min(MAX_SPLITS, programs // (n * shape.kv_heads)))
    splits = 1 << (splits.bit_length() - 1)  # a power of two, never above the budget
    group = shape.q_heads // shape.kv_heads
    s = scratch
    kc = tables.k_cache
    _decode_layers_kernel[(programs,)](
        s.res, s.mlp, s.q, s.attn, s.o, s.act, s.part, s.m, s.l_sum, s.sync,
        tables.ln1, tables.qkv, tables.qkv_bias, tables.q_norm, tables.k_norm, tables.o,
        tables.ln2, tables.gate_up, tables.down, kc, tables.v_cache,
        cos, sin, positions, token_req, slot_mapping, block_tables,
        n, splits, shape.eps, shape.head_dim**-0.5, cos.stride(0),
        shape.block_size * shape.kv_heads * shape.head_dim, shape.kv_heads * shape.head_dim,
        shape.head_dim, block_tables.stride(0),
        LAYERS=shape.layers, H=shape.hidden, INTER=shape.inter, Q_HEADS=shape.q_heads,
        KV_HEADS=shape.kv_heads, HEAD_DIM=shape.head_dim, BLOCK_SIZE=shape.block_size,
        HAS_BIAS=shape.qkv_bias, QK_NORM=shape.qk_norm, BLOCK_M=MAX_ROWS, BLOCK_K=BLOCK_K,
        NORM_K=min(NORM_K, triton.next_power_of_2(shape.hidden)),
        BLOCK_N_UP=_up_block_n(shape.inter, programs), BLOCK_N_PLAIN=BLOCK_N_PLAIN,
        BLOCK_N_ATT=BLOCK_N, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        MAX_SPLITS=MAX_SPLITS, LINES_H=_lines(shape.hidden),
        LINES_QS=_lines(shape.q_heads * shape.head_dim), LINES_I=_lines(shape.inter),
        # Triton's interpreter (the CPU check of this kernel) runs no inline assembly.
        PREFETCH=os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=4, num_stages=3,
    )  # fmt: skip
