"""The ostinato torch.compile backend: split at attention, compile pieces, graph them."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ostinato.capture_report import CaptureMeter
from ostinato.graph import GraphOptions, GraphWrapper
from ostinato.modes import GraphMode
from ostinato.piecewise.split import NoSplittingOpError, Piece, SplitGraph, split_graph
from ostinato.platform import Platform, current_platform
from ostinato.pool import shared_pool

logger = logging.getLogger(__name__)

# The engine's attention op, and its QKV op, which writes the step's K/V to the layer's
# cache named by an int argument: inside a piece that int would make every layer's
# piece a different graph, so it runs between them, as attention does.
DEFAULT_SPLITTING_OPS = ("ostinato::attention", "ostinato::norm_qkv")
# Inductor settings for every piece. A piece is replayed mostly at small token counts
# (decode), where Inductor would split each row reduction into a partial and a final
# kernel to fill the GPU: two launches where one block does the row in about the time of
# one. And it would compile every pointwise kernel in several launch configs and time
# them at the first call: four Triton compilations per kernel at start-up, to choose
# among configs that differ little on kernels this small.
PIECE_PATCHES = {"split_reductions": False, "triton.autotune_pointwise": False}


@dataclass
class CompileStats:
    """What compiling cost: one entry per Dynamo graph handed to the backend."""

    compiles: int = 0
    seconds: float = 0.0
    pieces: list[Piece] = field(default_factory=list)
    # Graphable pieces compiled, and how many of them reused an identical piece's code
    # (a model's middle layers split into identical pieces: compiled once).
    piece_compiles: int = 0
    piece_reuses: int = 0


class PiecewiseBackend:
    """A ``torch.compile`` backend that graphs a model piecewise around its attention.

    Each graph Dynamo hands over is split at ``splitting_ops``; every other piece is
    compiled (``compiler="inductor"``, or ``"eager"`` to run the FX pieces as they are)
    and wrapped in ``GraphWrapper(PIECEWISE)``, which captures it per batch descriptor
    when the forward context says PIECEWISE and runs it plainly otherwise. The last
    piece returns non-owning views (nothing captured later reads them). Compile the
    model with a dynamic batch dimension (``mark_dynamic``) so one compilation serves
    every size; ``stats`` says how many compilations happened and how long they took.
    ``inductor_patches``: Inductor config overrides for every piece (for example
    ``{"triton.enable_pdl": True}``).
    """

    def __init__(
        self,
        splitting_ops: Sequence[str] = DEFAULT_SPLITTING_OPS,
        *,
        compiler: str = "inductor",
        check_addresses: bool = False,
        lazy_capture: bool = False,
        platform: Platform | None = None,
        pool: Any = None,
        meter: CaptureMeter | None = None,
        inductor_patches: Mapping[str, Any] | None = None,
    ) -> None:
        if compiler not in ("inductor", "eager"):
            raise ValueError(f"compiler: 'inductor' or 'eager', got {compiler!r}")
        self.splitting_ops = tuple(splitting_ops)
        self.compiler = compiler
        self.check_addresses = check_addresses
        self.lazy_capture = lazy_capture
        self.platform = platform or current_platform()
        self.pool = pool if pool is not None else shared_pool(self.platform)
        self.meter = meter
        self.inductor_patches = dict(inductor_patches or {})
        self.stats = CompileStats()
        self.wrappers: list[GraphWrapper] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        split = split_graph(gm, self.splitting_ops)
        compiled = _compile_pieces(
            split, example_inputs, self.compiler, self.stats, self.inductor_patches
        )
        graphable = split.graphable
        for i, piece in enumerate(graphable):
            options = GraphOptions(
                weak_ref_output=i == len(graphable) - 1,
                check_addresses=self.check_addresses,
                lazy_capture=self.lazy_capture,
            )
            wrapper = GraphWrapper(
                compiled[piece.name],
                GraphMode.PIECEWISE,
                options=options,
                pool=self.pool,
                platform=self.platform,
                meter=self.meter,
                name=f"piece {piece.name} ({piece.source})",
            )
            # The generated forward calls self.<piece>; an instance attribute wins over
            # the registered submodule, and a GraphWrapper is not an nn.Module.
            split.module.__dict__[piece.name] = wrapper
            self.wrappers.append(wrapper)
        self.stats.compiles += 1
        self.stats.seconds += time.perf_counter() - start
        self.stats.pieces = split.pieces
        logger.info(
            "ostinato: compiled %d pieces (%d graphable) in %.1f s",
            len(split.pieces),
            len(graphable),
            time.perf_counter() - start,
        )
        return split.module

    @property
    def num_graphs(self) -> int:
        """Piecewise graphs captured so far, over all pieces."""
        return sum(len(w.entries) for w in self.wrappers)

    def release(self) -> None:
        """Destroys every piecewise graph (the compiled pieces stay, and run eagerly or
        capture anew). The device is synchronized first so no replay is in flight."""
        self.platform.synchronize()
        for wrapper in self.wrappers:
            wrapper.reset()


class _PieceCompiler(fx.Interpreter):
    """Walks the split graph on fake inputs, compiling each graphable piece on the way;
    a piece with the same structure and input metadata as one already compiled (the
    model's identical layers: their weights are inputs, not constants) reuses its code."""

    def __init__(
        self,
        split: SplitGraph,
        compiler: str,
        stats: CompileStats,
        patches: Mapping[str, Any],
    ) -> None:
        super().__init__(split.module)
        self.patches = patches
        self.graphable = {p.name for p in split.graphable}
        self.compiler = compiler
        self.stats = stats
        self.compiled: dict[str, Callable[..., Any]] = {}
        self.by_structure: dict[str, Callable[..., Any]] = {}

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        sub = self.fetch_attr(target)
        if target in self.graphable:
            key = _structure_key(sub, args)
            if key is not None and key in self.by_structure:
                self.compiled[target] = self.by_structure[key]
                self.stats.piece_reuses += 1
            else:
                if self.compiler == "inductor":
                    from torch._inductor.compile_fx import compile_fx

                    self.compiled[target] = compile_fx(
                        sub, list(args), config_patches={**PIECE_PATCHES, **self.patches}
                    )
                else:
                    self.compiled[target] = sub
                self.stats.piece_compiles += 1
                if key is not None:
                    self.by_structure[key] = self.compiled[target]
        return sub(*args, **kwargs)


def _structure_key(gm: fx.GraphModule, args: tuple[Any, ...]) -> str | None:
    """A text that is equal for two pieces exactly when they compute the same function of
    their inputs: their nodes with names replaced by positions, and their inputs' shapes,
    strides and dtypes. None for a piece that reads module state (``get_attr``,
    ``call_module``), which never shares code."""
    index: dict[fx.Node, int] = {}
    nodes = []
    for i, node in enumerate(gm.graph.nodes):
        if node.op in ("get_attr", "call_module"):
            return None
        index[node] = i
        target = None if node.op in ("placeholder", "output") else node.target
        refs = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        nodes.append((node.op, target, refs))
    inputs = [
        (tuple(a.shape), a.stride(), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else a
        for a in args
    ]
    return repr((nodes, inputs))


def _compile_pieces(
    split: SplitGraph,
    example_inputs: list[Any],
    compiler: str,
    stats: CompileStats,
    patches: Mapping[str, Any],
) -> dict[str, Callable[..., Any]]:
    from torch._guards import detect_fake_mode

    # Dynamo's fake mode maps each real example input to its fake twin with symbolic
    # sizes, so pieces compile for every batch size, not the example's.
    fake_mode = detect_fake_mode(example_inputs)
    fake_inputs = [
        fake_mode.from_tensor(x) if fake_mode is not None and isinstance(x, torch.Tensor) else x
        for x in example_inputs
    ]
    interpreter = _PieceCompiler(split, compiler, stats, patches)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        interpreter.run(*fake_inputs)
    return interpreter.compiled


_entries = itertools.count()


def _entry_template(*args: Any) -> Any:
    return module(*args)  # noqa: F821  (``module`` is each copy's own global)


def own_entry(module: torch.nn.Module) -> Callable[..., Any]:
    """A function that calls ``module``, with a code object of its own. Dynamo keeps
    compiled code per code object, with a limit of 8 variants: compiling ``module``
    itself would put every engine of the process (each new backend, dtype or shape a
    variant) in the one cache of the model class's ``forward``, and the ninth engine
    would fail to compile."""
    n = next(_entries)
    code = _entry_template.__code__.replace(
        co_name=f"ostinato_entry_{n}", co_qualname=f"ostinato_entry_{n}"
    )
    return types.FunctionType(code, {"module": module, "__builtins__": __builtins__})


class _WeakBackend:
    """What Dynamo is handed as the backend. Dynamo keeps every backend it was given for
    the life of the process; this holds the real one weakly, so an engine's pieces and
    graphs are freed with the engine."""

    def __init__(self, backend: PiecewiseBackend) -> None:
        self.ref = weakref.ref(backend)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        backend = self.ref()
        if backend is None:
            raise RuntimeError("ostinato: this compiled model's backend was released")
        return backend(gm, example_inputs)


def forget_entry(code: types.CodeType, entry_globals: dict[str, Any]) -> None:
    """Drops Dynamo's cached entries for ``code`` (where this torch can) and the module
    its globals held, so a released compiled model keeps nothing alive."""
    reset_code = getattr(torch._dynamo, "reset_code", None)
    if reset_code is not None:  # without it the module still goes with its global
        reset_code(code)
    entry_globals.pop("module", None)


class CompiledModel:
    """``torch.compile(module, backend=backend, fullgraph=True)`` compiled once for all sizes.

    Every tensor argument's dim 0 must be the token dimension: on the first call it is
    marked unbacked, so Dynamo neither specialises on the first size nor on size 1, and
    one compilation serves every batch. Errors raised by the backend (no splitting op,
    a piece that cannot compile) surface as themselves, not wrapped by Dynamo.
    """

    def __init__(self, module: torch.nn.Module, backend: PiecewiseBackend) -> None:
        self.module = module
        self.backend = backend
        self._entry = own_entry(module)
        self._compiled = torch.compile(self._entry, backend=_WeakBackend(backend), fullgraph=True)
        # Dynamo's compiled code for the entry holds the module (and the backend, with
        # its graphs) in a reference cycle through the code object that the garbage
        # collector cannot see: it is dropped by hand when this object is released.
        self._forget = weakref.finalize(
            self, forget_entry, self._entry.__code__, self._entry.__globals__
        )

    def release(self) -> None:
        """Drops Dynamo's compiled code for this model, so the module and the backend
        can be freed (also done when this object is garbage collected). This compiled
        model must not be called afterwards; releasing twice is harmless."""
        self._forget()

    def __call__(self, *args: Any) -> Any:
        if self.backend.stats.compiles:
            return self._compiled(*args)
        for a in args:
            if isinstance(a, torch.Tensor):
                torch._dynamo.decorators.mark_unbacked(a, 0)
        try:
            return self._compiled(*args)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            inner = getattr(exc, "inner_exception", None)
            if isinstance(inner, NoSplittingOpError):
                raise inner from None
            raise
