"""Static output buffers of FULL graphs: where every graph writes, and what callers read."""

from __future__ import annotations

import torch

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def as_tuple(out: Outputs) -> tuple[torch.Tensor, ...]:
    """``out`` as a tuple of tensors."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class StaticOutputs:
    """One buffer per step output, ``[rows, *shape]``, allocated once from the first output.

    Guarantees: the buffers never move (graphs capture writes into them); ``view(n)``
    returns the first ``n`` rows in the step's own form (a tensor, or a tuple when the step
    returns several) without allocating on the hot path, since every view is built once.
    ``write`` copies an output only where it is not already the buffer's rows, so a step
    that wrote into ``into(n)`` (offered through ``ForwardContext.outputs``) records no
    copy.
    """

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.buffers: tuple[torch.Tensor, ...] | None = None
        self.is_tuple = False
        self._views: list[Outputs] = []

    @property
    def allocated(self) -> bool:
        """True once the buffers exist."""
        return self.buffers is not None

    def allocate(self, out: Outputs) -> None:
        """Allocates buffers shaped like ``out`` (tokens on dim 0) with ``rows`` rows."""
        outs = as_tuple(out)
        self.is_tuple = isinstance(out, (tuple, list))
        self.buffers = tuple(
            torch.empty((self.rows, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in outs
        )
        self._views = [self._slice(n) for n in range(self.rows + 1)]

    def into(self, n: int) -> tuple[torch.Tensor, ...]:
        """The first ``n`` rows of every buffer, in the step's order: where a step may
        write its outputs itself."""
        assert self.buffers is not None
        return tuple(buf[:n] for buf in self.buffers)

    def write(self, out: Outputs, n: int) -> None:
        """Copies the ``n`` rows of ``out`` into the buffers (inside a capture: recorded),
        each output that is not already those rows of its buffer; ``ValueError`` where
        ``out`` is not shaped like them (buffers shared by two steps that differ)."""
        assert self.buffers is not None
        outs = as_tuple(out)
        if len(outs) != len(self.buffers) or any(
            t.dtype != buf.dtype or t.shape[1:] != buf.shape[1:]
            for t, buf in zip(outs, self.buffers, strict=False)
        ):
            raise ValueError(
                f"static outputs: the step returned {_shapes(outs)}, its buffers hold "
                f"{_shapes(self.buffers)}; steps sharing buffers must return the same "
                "shapes past the rows and dtypes"
            )
        for buf, t in zip(self.buffers, outs, strict=True):
            if not _is_rows_of(t, buf, n):
                buf[:n].copy_(t)

    def view(self, n: int) -> Outputs:
        """The first ``n`` rows, valid until the next replay writes them."""
        return self._views[n]

    def _slice(self, n: int) -> Outputs:
        rows = self.into(n)
        return rows if self.is_tuple else rows[0]


def _shapes(ts: tuple[torch.Tensor, ...]) -> list[str]:
    return [f"{list(t.shape[1:])}:{str(t.dtype).removeprefix('torch.')}" for t in ts]


def _is_rows_of(t: torch.Tensor, buf: torch.Tensor, n: int) -> bool:
    """Whether ``t`` is exactly ``buf[:n]``: the same memory, shape, strides and dtype."""
    return (
        t.data_ptr() == buf.data_ptr()
        and t.dtype == buf.dtype
        and t.shape == (n, *buf.shape[1:])
        and t.stride() == buf.stride()
    )
