"""Static output buffers of FULL graphs: where every graph writes, and what callers read."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ostinato.platform.base import Platform
from ostinato.tensor_views import weak_ref_tensor

Outputs = torch.Tensor | tuple[torch.Tensor, ...]
Reserve = Callable[[tuple[int, ...]], int]
"""Elements to reserve for a buffer of this shape (at least its own): room for the larger
outputs of the other steps that will share the storage."""


class OutputArena:
    """Storage shared by the static outputs of steps that never run at once (a
    ``graphed`` callable's signatures): per output position, dtype and device one flat
    buffer, and each step's buffers views of its first elements. A step that needs more
    than the buffer holds gets a new, larger one, which later steps share; the older one
    lives on in the views made of it, so no view ever moves.

    ``lock``: held by whoever runs or captures one of the sharing steps, from before it
    writes its outputs until its caller has copied (or queued the copy of) what it reads.

    Outputs can also be lent (``lend``): the caller gets aliases of the storage that do
    not own it, and every writer takes the lock through ``writing()``, which first makes
    any access to them raise ``revoked`` (``recall``): a kept output is an error, never a
    silently overwritten value.
    """

    def __init__(self, revoked: str = "an output lent until the next step was kept") -> None:
        self.lock = threading.RLock()
        self.revoked = revoked
        self._flat: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._made: set[int] = set()  # every storage's address (older ones still in views)
        self._lent: list[tuple[Platform, Any]] = []
        self._lent_at: set[int] = set()  # the lent aliases' addresses

    def take(
        self, index: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
        reserve: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        """A ``shape`` view of the first elements of output ``index``'s storage, which
        holds at least ``reserve`` elements when it has to be made."""
        numel = math.prod(shape)
        flat = self._flat.get((index, dtype, device))
        if flat is None or flat.numel() < numel:
            flat = torch.empty(max(numel, reserve), dtype=dtype, device=device)
            self._flat[(index, dtype, device)] = flat
            self._made.add(flat.untyped_storage().data_ptr())
        return flat[:numel].view(shape)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in storage this arena made."""
        return t.untyped_storage().data_ptr() in self._made

    def lend(self, t: torch.Tensor, platform: Platform) -> torch.Tensor:
        """``t`` (one of this arena's outputs) as the caller's until the next ``recall``:
        an alias where ``platform`` can revoke one, else a copy."""
        alias = weak_ref_tensor(t)  # (a storage of its own: revoking it spares the arena's)
        handle = platform.revocable(alias)
        if handle is None:
            return t.clone()
        self._lent.append((platform, handle))
        self._lent_at.add(alias.untyped_storage().data_ptr())
        return alias

    def is_lent(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is (a view of) an alias lent since the last ``recall``."""
        return bool(self._lent_at) and t.untyped_storage().data_ptr() in self._lent_at

    def recall(self) -> None:
        """Every alias lent so far (and its views) raises ``revoked`` on any access."""
        with self.lock:
            lent, self._lent = self._lent, []
            self._lent_at.clear()
            for platform, handle in lent:
                platform.revoke(handle, self.revoked)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """The lock, for a step or capture that writes the storage, once what was lent
        from it has been recalled."""
        with self.lock:
            self.recall()
            yield

    def nbytes(self) -> int:
        """Bytes of the storage the next step would share (older storage not counted)."""
        return sum(t.numel() * t.element_size() for t in self._flat.values())


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
        self._arena: OutputArena | None = None
        self._reserve: Reserve | None = None

    def share(self, arena: OutputArena, reserve: Reserve | None = None) -> None:
        """Takes the buffers from ``arena`` when they are allocated (``reserve``: how
        much to make room for where the storage is made); before ``allocate`` only."""
        if self.allocated:
            raise RuntimeError("static outputs: share() after the buffers were allocated")
        self._arena, self._reserve = arena, reserve

    @property
    def allocated(self) -> bool:
        """True once the buffers exist."""
        return self.buffers is not None

    def allocate(self, out: Outputs) -> None:
        """Allocates buffers shaped like ``out`` (tokens on dim 0) with ``rows`` rows."""
        outs = as_tuple(out)
        self.is_tuple = isinstance(out, (tuple, list))
        self.buffers = tuple(self._buffer(i, t) for i, t in enumerate(outs))
        self._views = [self._slice(n) for n in range(self.rows + 1)]

    def _buffer(self, index: int, t: torch.Tensor) -> torch.Tensor:
        shape = (self.rows, *t.shape[1:])
        if self._arena is None:
            return torch.empty(shape, dtype=t.dtype, device=t.device)
        reserve = self._reserve(shape) if self._reserve is not None else 0
        return self._arena.take(index, shape, t.dtype, t.device, reserve)

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
