"""A step's inputs to its first layer as the custom op ``ostinato::embed_rope``: the
embedding rows of its token ids and the RoPE table rows of its positions
(``rope.rope_table``: ``[N, 2, 1, head_dim]``, cos then sin). On CUDA one Triton kernel
(``kernels/embed_rope.py``), elsewhere torch's two lookups; both copy rows, so the
outputs are the lookups' bits everywhere.

Why an op: eagerly (the FULL decode graphs) the two lookups are two kernels before the
first layer, neither launched with programmatic dependent launch, so the first layer's
kernel could start its weight read only after both (``LaunchRules.embed_rope`` has the
measurement).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

Pair = tuple[Tensor, Tensor]

_lib = torch.library.Library("ostinato", "FRAGMENT")
_lib.define(
    "embed_rope(Tensor ids, Tensor positions, Tensor embed, Tensor table, bool pdl=False, "
    "int vocab_start=0) -> (Tensor, Tensor)"
)


def _check(ids: Tensor, positions: Tensor, embed: Tensor, table: Tensor) -> None:
    if ids.dim() != 1 or positions.shape != ids.shape or embed.dim() != 2 or table.dim() < 2:
        raise ValueError(
            f"embed_rope: needs ids and positions [n], embed [V, H] and a table [N, ...]; "
            f"got {tuple(ids.shape)}, {tuple(positions.shape)}, {tuple(embed.shape)}, "
            f"{tuple(table.shape)}"
        )


def embed_rope_reference(
    ids: Tensor, positions: Tensor, embed: Tensor, table: Tensor, vocab_start: int = 0
) -> Pair:
    """(``embed[ids - vocab_start]``, ``table[positions]``) in torch: zeros for an id
    whose row is not in ``embed`` (under tensor parallelism a rank's shard of the
    vocabulary)."""
    _check(ids, positions, embed, table)
    local = ids - vocab_start
    mine = (local >= 0) & (local < embed.shape[0])
    x = F.embedding(torch.where(mine, local, torch.zeros_like(local)), embed)
    return torch.where(mine[:, None], x, torch.zeros_like(x)), table[positions]


def _outputs(ids: Tensor, positions: Tensor, embed: Tensor, table: Tensor) -> Pair:
    """The op's outputs, unwritten, after its checks."""
    _check(ids, positions, embed, table)
    n = ids.shape[0]
    return embed.new_empty((n, embed.shape[1])), table.new_empty((n, *table.shape[1:]))


def _embed_rope(
    ids: Tensor,
    positions: Tensor,
    embed: Tensor,
    table: Tensor,
    pdl: bool = False,
    vocab_start: int = 0,
) -> Pair:
    if not embed.is_cuda:  # ``pdl`` is a launch option of the kernel
        return embed_rope_reference(ids, positions, embed, table, vocab_start)
    from ostinato.engine.kernels.embed_rope import embed_rope_rows

    x, rows = _outputs(ids, positions, embed, table)
    flat_table = table.contiguous().view(table.shape[0], -1)
    rope = rows.view(len(ids), -1)
    embed_rope_rows(ids, positions, embed.contiguous(), flat_table, x, rope, pdl, vocab_start)
    return x, rows


_lib.impl("embed_rope", _embed_rope, "CompositeExplicitAutograd")


@torch.library.register_fake("ostinato::embed_rope", lib=_lib)
def _(
    ids: Tensor,
    positions: Tensor,
    embed: Tensor,
    table: Tensor,
    pdl: bool = False,
    vocab_start: int = 0,
) -> Pair:
    return _outputs(ids, positions, embed, table)
