"""Where FULL graphs' outputs live: static buffers every graph writes (``StaticOutputs``,
the engine's: its sampling reads them), or each graph's own memory in its pool
(``PoolOutputs``, ``graphed``'s: no buffer apart, no copy), lent to callers by an
``OutputLender`` until anything writes the pool again."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ostinato.platform.base import Platform
from ostinato.tensor_views import weak_ref_tensor

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class _Loan:
    owner: object
    platform: Platform
    handle: Any
    revoked: str


class OutputLender:
    """A graph pool (``pool``) whose graphs' outputs are lent to callers: aliases of the
    pool's memory that do not own it, each valid until the next ``recall``.

    ``lock``: held by whoever replays or captures into the pool (``writing()``, or
    ``acquire`` and ``release``), from before it writes until its caller has lent (or
    copied) what it reads. Taking it first recalls every loan: any access to a recalled
    alias, or to a view of it, raises the message it was lent with. A kept output is an
    error, never a silently overwritten value.
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.lock = threading.RLock()
        self._loans: list[_Loan] = []
        self._lent_at: set[int] = set()  # the aliases' addresses

    def lend(
        self, t: torch.Tensor, platform: Platform, revoked: str, owner: object
    ) -> torch.Tensor:
        """``t`` (a graph's output) as the caller's until the next ``recall``: an alias
        where ``platform`` can revoke one (raising ``revoked`` once recalled), else a copy."""
        alias = weak_ref_tensor(t)  # (a storage of its own: revoking it spares the graph's)
        handle = platform.revocable(alias)
        if handle is None:
            return t.clone()
        self._loans.append(_Loan(owner, platform, handle, revoked))
        self._lent_at.add(alias.untyped_storage().data_ptr())
        return alias

    def is_lent(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is (a view of) an alias lent since the last ``recall``."""
        return bool(self._lent_at) and t.untyped_storage().data_ptr() in self._lent_at

    def recall(self, owner: object | None = None) -> None:
        """Every alias lent so far (only ``owner``'s, where given) and its views raise
        on any access from now on."""
        with self.lock:
            loans = [x for x in self._loans if owner is None or x.owner is owner]
            self._loans = [x for x in self._loans if owner is not None and x.owner is not owner]
            if not self._loans:
                self._lent_at.clear()
            for x in loans:
                x.platform.revoke(x.handle, x.revoked)

    def acquire(self, blocking: bool = True) -> bool:
        """Takes the lock (without ``blocking``, only if free: returns whether it did),
        then recalls every loan."""
        if not self.lock.acquire(blocking=blocking):
            return False
        self.recall()
        return True

    def release(self) -> None:
        """Lets the lock go."""
        self.lock.release()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """The lock, for a step or capture that writes the pool, once what was lent from
        it has been recalled."""
        self.acquire()
        try:
            yield
        finally:
            self.release()


_lenders: weakref.WeakKeyDictionary[Platform, OutputLender] = weakref.WeakKeyDictionary()
_lenders_lock = threading.Lock()  # (two callables' first calls on two threads: one lender)


def shared_lender(platform: Platform) -> OutputLender:
    """The process's lender of ``platform``, with a pool of its own (not the engine's
    ``shared_pool``, whose replays do not recall loans): every ``graphed`` callable on
    the platform captures into it, so their graphs share memory, and a call of any of
    them recalls what the others lent."""
    with _lenders_lock:
        if platform not in _lenders:
            _lenders[platform] = OutputLender(platform.graph_pool_handle())
        return _lenders[platform]


def lent_anywhere(t: torch.Tensor) -> bool:
    """Whether ``t`` is (a view of) an alias a lender of this process lent since its
    last recall (a call's argument that its own writes may revoke: copy it first)."""
    with _lenders_lock:
        lenders = list(_lenders.values())
    return any(lender.is_lent(t) for lender in lenders)


class PoolOutputs:
    """A manager's FULL graphs' outputs where each capture allocated them, in the pool,
    as reduce-overhead and vLLM's graph wrapper leave them: no buffer beside the pool,
    no copy after a replay. The capture drops its owning tensors (``GraphEntry.output``
    keeps non-owning views), so later captures reuse that memory: a graph's outputs are
    valid after its replay until anything writes the pool again (``OutputLender``).

    ``holds(t)``: whether ``t`` is (a view of) an output of a graph captured here since
    the last ``forget()``.
    """

    allocated = True  # (nothing to size: the first capture needs no eager output)

    def __init__(self) -> None:
        self._at: set[int] = set()  # the outputs' storage addresses

    def allocate(self, out: Outputs) -> None:
        """Nothing: ``allocated`` is always True."""

    def into(self, n: int) -> None:
        """None: no buffer to offer a step (``ForwardContext.outputs``)."""
        return None

    def keep(self, out: Outputs, n: int) -> Outputs:
        """(At capture) notes where ``out`` lives and returns it: the graph's outputs."""
        self._at.update(t.untyped_storage().data_ptr() for t in as_tuple(out))
        return out

    def read(self, replayed: Outputs, n: int) -> Outputs:
        """The first ``n`` rows of a replay's outputs (``GraphEntry.output``)."""
        return first_rows(replayed, n)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is (a view of) one of these graphs' outputs."""
        return t.untyped_storage().data_ptr() in self._at

    def forget(self) -> None:
        """Every graph is gone: no address is theirs any more (an input buffer's, once
        freed, may hold an eager output)."""
        self._at.clear()


def as_tuple(out: Outputs) -> tuple[torch.Tensor, ...]:
    """``out`` as a tuple of tensors."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def first_rows(out: Outputs, n: int) -> Outputs:
    """The first ``n`` rows of each output, in ``out``'s form (a tensor, or a tuple)."""
    if isinstance(out, (tuple, list)):
        return tuple(t[:n] for t in out)
    return out[:n]


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
        self.buffers = tuple(self._buffer(i, t) for i, t in enumerate(outs))
        self._views = [self._slice(n) for n in range(self.rows + 1)]

    def _buffer(self, index: int, t: torch.Tensor) -> torch.Tensor:
        return torch.empty((self.rows, *t.shape[1:]), dtype=t.dtype, device=t.device)

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

    def keep(self, out: Outputs, n: int) -> None:
        """(At capture) ``write``: the graph's outputs are the buffers, not ``out``."""
        self.write(out, n)

    def read(self, replayed: Outputs, n: int) -> Outputs:
        """``view(n)``: what a replay wrote (``replayed``, a graph's own outputs, is None)."""
        return self.view(n)

    def view(self, n: int) -> Outputs:
        """The first ``n`` rows, valid until the next replay writes them."""
        return self._views[n]

    def forget(self) -> None:
        """Nothing: the buffers outlive the graphs."""

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
