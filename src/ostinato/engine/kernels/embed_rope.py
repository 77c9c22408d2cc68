"""The kernel behind ``ostinato::embed_rope`` on CUDA: a step's embedding rows and RoPE
table rows in one launch, a program per token, so the first layer's kernel (launched
with programmatic dependent launch) starts its weight read while the rows are copied
instead of after two gather kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.launch import launch, pdl_arg, pdl_for
from ostinato.engine.kernels.pdl import pdl_enter


@triton.jit
def _embed_rope_kernel(
    ids_ptr,
    pos_ptr,
    embed_ptr,
    table_ptr,
    x_ptr,
    rope_ptr,
    hidden,
    rope_width,
    positions_n,
    vocab_start,
    vocab_n,
    stride_e,
    stride_x,
    stride_t,
    stride_r,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)  # the ids and positions may be an earlier kernel's output
    row = tl.program_id(0).to(tl.int64)
    token = tl.load(ids_ptr + row).to(tl.int64) - vocab_start
    pos = tl.load(pos_ptr + row).to(tl.int64)
    pos = tl.where(pos < 0, pos + positions_n, pos)  # a padding row's -1: the last row
    cols = tl.arange(0, BLOCK_H)
    # A token of another rank's vocabulary shard reads nothing and writes zeros.
    mine = (token >= 0) & (token < vocab_n)
    mask = cols < hidden
    x = tl.load(embed_ptr + tl.where(mine, token, 0) * stride_e + cols, mask=mask & mine, other=0.0)
    tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    rc = tl.arange(0, BLOCK_R)
    rmask = rc < rope_width
    r = tl.load(table_ptr + pos * stride_t + rc, mask=rmask)
    tl.store(rope_ptr + row * stride_r + rc, r, mask=rmask)


def embed_rope_rows(
    ids: torch.Tensor,
    positions: torch.Tensor,
    embed: torch.Tensor,
    table: torch.Tensor,
    x: torch.Tensor,
    rope: torch.Tensor,
    pdl: bool = False,
    vocab_start: int = 0,
) -> None:
    """``x[i] = embed[ids[i] - vocab_start]`` (zeros where that is not a row of ``embed``:
    a token of another rank's shard of the vocabulary) and ``rope[i] =
    table[positions[i]]`` (a position of -1 reads the last row, as torch's indexing
    does) for every token ``i``. ``embed`` ``[V, H]``, ``x`` ``[n, H]`` with contiguous
    rows; ``table`` and ``rope`` 2-D views ``[N, W]`` and ``[n, W]`` of contiguous rows.
    Ids and positions must be in range (the engine checks them before a step); nothing
    is checked on the device."""
    n = ids.shape[0]
    if n == 0:
        return
    pdl = pdl_for(pdl, n)
    launch(
        _embed_rope_kernel,
        (n,),
        ids, positions, embed, table, x, rope,
        embed.shape[1], table.shape[1], table.shape[0], vocab_start, embed.shape[0],
        embed.stride(0), x.stride(0), table.stride(0), rope.stride(0),
        BLOCK_H=triton.next_power_of_2(embed.shape[1]),
        BLOCK_R=triton.next_power_of_2(table.shape[1]),
        USE_PDL=pdl_arg(pdl),
        num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip
