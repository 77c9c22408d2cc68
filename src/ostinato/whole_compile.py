"""One ``torch.compile`` of a graphed function per family of signatures.

``graphed`` keys its graphs by signature: the tree of arguments, the constants, and each
tensor's dtype, device and shape past the batch, the sequence at its bucket. Signatures
that differ only in their sequence bucket run the same code on tensors of other lengths,
so they share one compilation here, with the batch and the sequence dimensions marked
dynamic: a model served at three sequence buckets compiles once, not three times.

Guarantees: ``SharedCompiles.whole`` returns the same ``WholeCompiled`` for every
signature of a family and for nothing else; a ``WholeCompiled`` calls the function it was
made from (``CallTree``: the family's constants with the tensors put back in their
places), so its outputs are the function's on the same tensors.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_unflatten


@dataclass(frozen=True)
class CallTree:
    """``fn`` called on its argument tree: ``constants`` (a leaf per place, None where a
    tensor goes), the tensors' places (``slots``) and the tree (``spec``)."""

    fn: Callable[..., Any]
    constants: tuple[Any, ...]
    slots: tuple[int, ...]
    spec: TreeSpec

    def __call__(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self.constants)
        for slot, t in zip(self.slots, tensors, strict=True):
            leaves[slot] = t
        args, kwargs = tree_unflatten(leaves, self.spec)
        return self.fn(*args, **kwargs)


class WholeCompiled:
    """``torch.compile(fn, backend=compiler)``, the batch dimension (and ``seq_dim`` of
    the tensors that have it) dynamic where ``fn`` allows it: one compilation for every
    bucket; else one per bucket. Through an entry function of its own (Dynamo's limit of
    8 variants is per code object)."""

    def __init__(self, fn: Callable[..., Any], compiler: str, seq_dim: int | None = None) -> None:
        from ostinato.piecewise.backend import forget_entry, own_entry

        entry = own_entry(AsModule(fn))
        self.seq_dim = seq_dim
        self._compiled = torch.compile(entry, backend=compiler)
        self._forget = weakref.finalize(self, forget_entry, entry.__code__, entry.__globals__)

    def __call__(self, *tensors: torch.Tensor) -> Any:
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            if self.seq_dim is not None and t.dim() > self.seq_dim:
                torch._dynamo.maybe_mark_dynamic(t, self.seq_dim)
        return self._compiled(*tensors)


class AsModule(torch.nn.Module):
    """``fn`` as a module (what Dynamo and the piecewise backend compile)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *tensors: torch.Tensor) -> Any:
        return self.fn(*tensors)


def family_key(key: tuple[Any, ...], seq_dim: int | None) -> tuple[Any, ...]:
    """A ``signature_key`` without the sequence lengths: the key of the signatures that
    may share one compilation (``seq_dim`` None: no sequence buckets, the key itself)."""
    if seq_dim is None:
        return key
    spec, constants, tensors = key
    blanked = tuple(
        (tuple(None if i == seq_dim - 1 else n for i, n in enumerate(shape)), dtype, device)
        for shape, dtype, device in tensors
    )
    return (spec, constants, blanked)


class SharedCompiles:
    """Per ``graphed`` function: one ``WholeCompiled`` per (compiler, family)."""

    def __init__(self) -> None:
        self._made: dict[tuple[Any, ...], WholeCompiled] = {}
        self._lock = threading.Lock()  # (two signatures' upgrades may ask at once)

    def whole(
        self, tree: CallTree, key: tuple[Any, ...], compiler: str, seq_dim: int | None
    ) -> WholeCompiled:
        """The family's compilation of ``tree`` (made from the first member's tree: the
        members' trees differ only in the lengths of their tensors)."""
        family = (compiler, family_key(key, seq_dim))
        with self._lock:
            found = self._made.get(family)
            if found is None:
                found = self._made[family] = WholeCompiled(tree, compiler, seq_dim)
            return found

    def clear(self) -> None:
        """Forgets every compilation (their code goes with the last reference)."""
        with self._lock:
            self._made.clear()
