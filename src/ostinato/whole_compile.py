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

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_unflatten

from ostinato import compile_artifacts
from ostinato.compile_artifacts import ArtifactStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallTree:
    """``fn`` called on its argument tree: ``constants`` (a leaf per place, None where a
    tensor goes), the tensors' places (``slots``) and the tree (``spec``).

    A flat call (positional and keyword leaves, nothing nested) is rebuilt without the
    pytree walk: tracing ``tree_unflatten`` guards on the identity of the tree's node
    types (``tuple``, ``dict``), a guard Dynamo cannot save with a compiled function
    (torch 2.11: "ID_MATCH guard cannot be serialized"), so no such call could be kept."""

    fn: Callable[..., Any]
    constants: tuple[Any, ...]
    slots: tuple[int, ...]
    spec: TreeSpec
    keywords: tuple[str, ...] | None = field(init=False)  # None: nested, unflattened

    def __post_init__(self) -> None:
        object.__setattr__(self, "keywords", flat_keywords(self.spec))

    def __call__(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self.constants)
        for slot, t in zip(self.slots, tensors, strict=True):
            leaves[slot] = t
        if self.keywords is None:
            args, kwargs = tree_unflatten(leaves, self.spec)
            return self.fn(*args, **kwargs)
        split = len(leaves) - len(self.keywords)
        kwargs = {name: leaves[split + i] for i, name in enumerate(self.keywords)}
        return self.fn(*leaves[:split], **kwargs)


def _children(spec: TreeSpec) -> list[TreeSpec]:
    children = getattr(spec, "children", None)  # (newer torch; children_specs before)
    return list(children()) if callable(children) else list(spec.children_specs)


def flat_keywords(spec: TreeSpec) -> tuple[str, ...] | None:
    """For the tree of ``(args, kwargs)`` whose every argument is a leaf, the keywords'
    names in the leaves' order (after the positional ones); None for any other tree."""
    if spec.type is not tuple or spec.num_children != 2:
        return None
    args, kwargs = _children(spec)
    if args.type is not tuple or kwargs.type is not dict:
        return None
    if not all(c.is_leaf() for c in _children(args) + _children(kwargs)):
        return None
    return tuple(kwargs.context)


class WholeCompiled:
    """``torch.compile(fn, backend=compiler)``, the batch dimension (and ``seq_dim`` of
    the tensors that have it) dynamic where ``fn`` allows it: one compilation for every
    bucket; else one per bucket. Through an entry function of its own (Dynamo's limit of
    8 variants is per code object).

    With a ``store`` and a ``key`` (``compile_artifacts``), a call first tries the
    compiled functions an earlier process kept, then compiles ahead of time and keeps
    what it made; a function Dynamo cannot trace whole, or a torch that cannot save
    one, is compiled as above. ``loaded`` / ``saved``: how many artifacts were."""

    def __init__(
        self,
        fn: Callable[..., Any],
        compiler: str,
        seq_dim: int | None = None,
        store: ArtifactStore | None = None,
        key: str | None = None,
    ) -> None:
        from ostinato.piecewise.backend import forget_entry, own_entry

        self.module = AsModule(fn)
        entry = own_entry(self.module)
        self.seq_dim, self.compiler = seq_dim, compiler
        self._compiled = torch.compile(entry, backend=compiler)
        self._forget = weakref.finalize(self, forget_entry, entry.__code__, entry.__globals__)
        self._store = store if key is not None and compile_artifacts.supported() else None
        self._key = key
        self._kept: list[Any] | None = None  # loaded at the first call (a compile's thread)
        self.loaded = self.saved = 0

    def __call__(self, *tensors: torch.Tensor) -> Any:
        if self._store is not None:
            # Asked before the marks below: a loaded artifact's guards want the tensors
            # as they were at its compilation, which the marks were consumed by.
            for compiled in self._artifacts():
                if compiled.guard_check(self.module, *tensors):
                    return self._run(compiled, tensors)
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            if self.seq_dim is not None and t.dim() > self.seq_dim:
                torch._dynamo.maybe_mark_dynamic(t, self.seq_dim)
        made = self._ahead_of_time(tensors) if self._store is not None else None
        if made is None:
            return self._compiled(*tensors)
        out = self._run(made, tensors)
        if self._store is not None:  # it ran: kept, for this process and the next
            kept = self._artifacts()
            if self._store.save(self._key or "", len(kept), made):
                self.saved += 1
            kept.append(made)
        return out

    def _run(self, compiled: Any, tensors: tuple[torch.Tensor, ...]) -> Any:
        """``compiled`` on ``tensors``; where it fails, no artifact is used or kept from
        then on (the call runs the in-process compilation instead)."""
        try:
            return compiled(self.module, *tensors)
        except Exception as exc:  # torch's ahead-of-time path is experimental
            logger.warning(
                "ostinato: a compiled function failed (%s: %s); compiling in-process, "
                "nothing kept", type(exc).__name__, exc,
            )  # fmt: skip
            self._store, self._kept = None, []
            return self._compiled(*tensors)

    def _artifacts(self) -> list[Any]:
        if self._kept is None:
            assert self._store is not None and self._key is not None
            self._kept = self._store.load(self._key)
            self.loaded = len(self._kept)
        return self._kept

    def _ahead_of_time(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        """``fn`` compiled ahead of time for calls like this one; None (and no more
        tries) where Dynamo cannot trace it whole."""
        try:
            with compile_artifacts.enabled():
                whole = torch.compile(
                    self.module,
                    fullgraph=True,
                    backend=self.compiler,
                    options={"guard_filter_fn": compile_artifacts.savable_guards},
                )
                return whole.forward.aot_compile((tensors, {}))
        except Exception as exc:  # a graph break, or a torch without the ahead-of-time path
            logger.warning(
                "ostinato: not compiled ahead of time, so not kept for the next process "
                "(compiled here as usual): %s: %s", type(exc).__name__, exc,
            )  # fmt: skip
            self._store = None
            return None


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
    """Per ``graphed`` function: one ``WholeCompiled`` per (compiler, family), keeping
    Inductor's compiled functions in ``store`` where one is given (``compile_artifacts``;
    the other compilers compile nothing worth keeping)."""

    def __init__(self, store: ArtifactStore | None = None) -> None:
        self.store = store
        self._made: dict[tuple[Any, ...], WholeCompiled] = {}
        self._lock = threading.Lock()  # (two signatures' upgrades may ask at once)

    def whole(
        self,
        tree: CallTree,
        key: tuple[Any, ...],
        compiler: str,
        seq_dim: int | None,
        device: torch.device,
    ) -> WholeCompiled:
        """The family's compilation of ``tree`` (made from the first member's tree: the
        members' trees differ only in the lengths of their tensors)."""
        family = (compiler, family_key(key, seq_dim))
        with self._lock:
            found = self._made.get(family)
            if found is None:
                stored = None
                if self.store is not None and compiler == "inductor":  # (others: tests)
                    named = (family, seq_dim)
                    stored = compile_artifacts.artifact_key(tree.fn, named, compiler, device)
                found = WholeCompiled(tree, compiler, seq_dim, self.store, stored)
                self._made[family] = found
            return found

    def artifacts(self) -> tuple[int, int]:
        """Compiled functions loaded from the store and kept there, over every family."""
        with self._lock:
            made = list(self._made.values())
        return sum(w.loaded for w in made), sum(w.saved for w in made)

    def clear(self) -> None:
        """Forgets every compilation (their code goes with the last reference)."""
        with self._lock:
            self._made.clear()
