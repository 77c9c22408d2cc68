"""A step's adjusted logits in one pass on CUDA: ``sample.adjust.penalized``'s arithmetic,
``(logit + bias) - (presence·[count > 0] + frequency·count)`` in float32, each row's
counts read from the output counts' table through its row index. Torch spells it in
some eight kernels over ``[rows, vocab]`` float32 (the cast, the bias, the gather, the
mask, two products, a sum and the difference); here a program reads a block of a row's
logits, bias and counts once and writes the result once. The penalty is one ``fma``, so
every compilation of the kernel rounds it alike: a step sampled eagerly and its sampling
graph take the same tokens."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.engine.kernels.launch import launch

BLOCK = 2048  # logits a program reads: 75 programs for a row of a 152k vocabulary
WARPS = 4


@triton.jit
def penalized_block(x, row, cols, live, bias_ptr, table_ptr, rows_ptr, presence_ptr,
                    frequency_ptr, vocab, HAS_BIAS: tl.constexpr):  # fmt: skip
    """``x`` (float32, row ``row``'s ``cols``) plus its bias, less its penalties: the one
    arithmetic of every penalized step."""
    if HAS_BIAS:
        x = x + tl.load(bias_ptr + row * vocab + cols, mask=live, other=0.0)
    counts_row = tl.load(rows_ptr + row)
    c = tl.load(table_ptr + counts_row * vocab + cols, mask=live, other=0.0)
    presence = tl.load(presence_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    return x - tl.fma(frequency, c, tl.where(c > 0, presence, 0.0))


@triton.jit
def _penalize_kernel(
    x_ptr, x_stride, bias_ptr, table_ptr, rows_ptr, presence_ptr, frequency_ptr, out_ptr,
    vocab, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = cols < vocab
    x = tl.load(x_ptr + row * x_stride + cols, mask=live, other=0.0).to(tl.float32)
    x = penalized_block(
        x, row, cols, live, bias_ptr, table_ptr, rows_ptr, presence_ptr, frequency_ptr, vocab,
        HAS_BIAS,
    )  # fmt: skip
    tl.store(out_ptr + row * vocab + cols, x, mask=live)


def penalize_rows(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """``[n, vocab]`` float32: ``logits`` (``[n, vocab]``, any float dtype, any row
    stride) plus ``bias`` (``[n, vocab]`` float32, contiguous; None: none) minus each
    row's penalties (``presence``, ``frequency``: ``[n]`` float32) on its counts,
    ``table[rows[i]]`` (``table``: ``[*, vocab]`` float32, contiguous; ``rows``: ``[n]``
    int64)."""
    n, vocab = logits.shape
    out = torch.empty((n, vocab), dtype=torch.float32, device=logits.device)
    if n == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    launch(
        _penalize_kernel, (n, triton.cdiv(vocab, BLOCK)), logits, logits.stride(0),
        bias if bias is not None else out, table, rows, presence, frequency, out, vocab,
        HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=WARPS,
    )  # fmt: skip
    return out
