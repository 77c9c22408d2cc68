"""A step's inputs to its first layer as the custom op ``ostinato::embed_rope``: the
embedding rows of its token ids and the RoPE table rows of its positions
(``rope.rope_table``: ``[N, 2, 1, head_dim]``, cos then sin). On CUDA one Triton kernel
(``kernels/embed_rope.py``), elsewhere torch's two lookups; both copy rows, so the
outputs are the lookups' bits everywhere.

Why an op: eagerly (the FULL decode graphs) the two lookups are two kernels before the
first layer, neither launched with programmatic dependent launch, so the first layer's
kernel could start its weight read only after both (``decoder.EMBED_ROPE`` has the
measurement).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_lib = torch.library.Library("ostinato", "FRAGMENT")
_lib.define(
    "embed_rope(Tensor ids, Tensor positions, Tensor embed, Tensor table, bool pdl=False) "
    "-> (Tensor, Tensor)"
)


def _check(ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor, table: torch.Tensor):
    if ids.dim() != 1 or positions.shape != ids.shape or embed.dim() != 2 or table.dim() < 2:
        raise ValueError(
            f"embed_rope: needs ids and positions [n], embed [V, H] and a table [N, ...]; "
            f"got {tuple(ids.shape)}, {tuple(positions.shape)}, {tuple(embed.shape)}, "
            f"{tuple(table.shape)}"
        )


def embed_rope_reference(
    ids: torch.Tensor,
    positions: torch.Tensor,
    embed: torch.Tensor,
    table: torch.Tensor,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``embed[ids]``, ``table[positions]``) in torch (``pdl`` is a launch option of the
    kernel, ignored here)."""
    _check(ids, positions, embed, table)
    return F.embedding(ids, embed), table[positions]


def _embed_rope_cuda(
    ids: torch.Tensor,
    positions: torch.Tensor,
    embed: torch.Tensor,
    table: torch.Tensor,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    from ostinato.engine.kernels.embed_rope import embed_rope_rows

    _check(ids, positions, embed, table)
    n = ids.shape[0]
    x = torch.empty((n, embed.shape[1]), dtype=embed.dtype, device=embed.device)
    rows = torch.empty((n, *table.shape[1:]), dtype=table.dtype, device=table.device)
    embed_rope_rows(
        ids, positions, embed.contiguous(), table.contiguous().view(table.shape[0], -1),
        x, rows.view(n, -1), pdl,
    )  # fmt: skip
    return x, rows


_lib.impl("embed_rope", embed_rope_reference, "CompositeExplicitAutograd")
_lib.impl("embed_rope", _embed_rope_cuda, "CUDA")


@torch.library.register_fake("ostinato::embed_rope", lib=_lib)
def _(
    ids: torch.Tensor,
    positions: torch.Tensor,
    embed: torch.Tensor,
    table: torch.Tensor,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(ids, positions, embed, table)
    n = ids.shape[0]
    return embed.new_empty((n, embed.shape[1])), table.new_empty((n, *table.shape[1:]))
