"""``torch.compile(model, backend="ostinato")``: the graph Dynamo traced, served by
``graphed`` (the same ladder, graphs and statistics), so moving from
``mode="reduce-overhead"`` is one word. ``options=`` takes ``graphed``'s keyword
arguments (``max_batch_size``, ``seq_buckets``, ...). Registered with Dynamo through the
package's ``torch_dynamo_backends`` entry point.

Dynamo hands over a graph whose inputs are the module's parameters and buffers (the same
tensors at every call), the call's tensors, and, once a second batch size has made the
batch dynamic, the sizes the graph is traced over (SymInts). A compile traced for one
batch size (the first, and a batch of 1, which Dynamo specializes) is graphed at that size
alone: Dynamo's guards send every other size elsewhere. The dynamic compile is graphed
over the ladder: each call's tensors are padded to their bucket, the sizes are read back
from the padded tensors, and the graph runs at the bucket's size inside the graphs. A
graph whose call tensors do not share their first dimension, or with a size that is not a
dimension of a call tensor (a product of two), runs eagerly, and the log says why.

Guarantees: outputs equal the traced graph's; the ``Graphed`` of every compile it graphs
is kept in ``compiled_graphs()`` (its ``stats()``) for as long as Dynamo keeps the graph.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ostinato.callable_graphs import Graphed, graphed

logger = logging.getLogger(__name__)

_COMPILED: weakref.WeakSet[Graphed] = weakref.WeakSet()


def compiled_graphs() -> list[Graphed]:
    """The ``Graphed`` of each graph compiled by the backend and still in use."""
    return list(_COMPILED)


@dataclass(frozen=True)
class _Inputs:
    """Where each of the graph's inputs comes from (by its position): the module's
    tensors (kept), the call's tensors (graphed), and each size as (the position of the
    call tensor it is a dimension of, that dimension)."""

    kept: dict[int, torch.Tensor]
    tensors: tuple[int, ...]
    sizes: dict[int, tuple[int, int] | None]

    def assemble(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The graph's inputs, in order, around the call's (padded) ``tensors``."""
        by_index = dict(zip(self.tensors, tensors, strict=True))
        sizes = {i: by_index[t].shape[d] for i, (t, d) in self.sizes.items()}
        n = len(self.kept) + len(self.tensors) + len(self.sizes)
        return [self.kept.get(i, by_index.get(i, sizes.get(i))) for i in range(n)]


def ostinato_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """Dynamo's backend entry (see the module docstring)."""
    if mode is not None:
        raise ValueError(
            f"mode={mode!r}: the ostinato backend takes no mode; its options go through "
            "options={...} (graphed's keyword arguments)"
        )
    inputs = _inputs(gm, example_inputs)
    why = _eager_because(inputs, example_inputs)
    if why is not None:
        logger.warning("ostinato backend: %s; this graph runs eagerly", why)
        return gm.forward
    options = dict(options or {})
    # Graphs of Dynamo's graph as traced, from the first call. A staged start would compile
    # that graph again, with Inductor, on a thread, which no GPU test has covered yet: asked
    # for by name (options={"capture": "staged"}) only.
    options.setdefault("capture", "first_use")

    def run(*tensors: torch.Tensor) -> Any:
        return gm(*inputs.assemble(tensors))  # the sizes read from the padded tensors

    # Every option checked as given, by its name (graphed captures nothing before a call),
    # also where a graph traced for one batch then drops the ladder's.
    fast = graphed(run, **options)
    if not inputs.sizes:  # traced for one batch: graphs of that size alone
        batch = example_inputs[inputs.tensors[0]].shape[0]
        for name in ("max_batch_size", "capture_sizes", "seq_buckets", "seq_dim"):
            options.pop(name, None)
        fast = graphed(run, capture_sizes=(batch,), **options)
    _COMPILED.add(fast)

    def call(*args: Any) -> Any:
        return fast(*(args[i] for i in inputs.tensors))

    call.graphed = fast  # type: ignore[attr-defined]  (kept alive with Dynamo's graph)
    return call


def _eager_because(inputs: _Inputs, example_inputs: Sequence[Any]) -> str | None:
    """Why a graph cannot be graphed (None: it can)."""
    if not inputs.tensors:
        return "the traced graph takes no tensor of the call"
    tensors = [example_inputs[i] for i in inputs.tensors]
    firsts = {str(t.shape[0]) if t.dim() else "scalar" for t in tensors}
    if len(firsts) > 1:
        return f"its call tensors do not share their first dimension ({sorted(firsts)})"
    if None in inputs.sizes.values():
        return "a size of the traced graph is not a dimension of a call tensor"
    return None


def _inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> _Inputs:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kept, tensors, syms = {}, [], {}
    for i, (node, value) in enumerate(zip(placeholders, example_inputs, strict=True)):
        if isinstance(value, torch.Tensor):
            if getattr(value, "_dynamo_static_input_type", None) is not None:
                kept[i] = value  # a parameter or buffer: the same tensor at every call
            else:
                tensors.append(i)
        elif isinstance(value, torch.SymInt) or isinstance(
            node.meta.get("example_value"), torch.SymInt
        ):
            syms[i] = node.meta.get("example_value", value)
    sizes = {i: _dimension(sym, placeholders, tensors) for i, sym in syms.items()}
    return _Inputs(kept, tuple(tensors), sizes)  # type: ignore[arg-type]


def _dimension(sym: Any, placeholders: list[Any], tensors: list[int]) -> tuple[int, int] | None:
    """(position of a call tensor among the graph's inputs, dimension) whose size is
    ``sym``; None where no call tensor has it as a dimension."""
    for t in tensors:
        fake = placeholders[t].meta.get("example_value")
        for d, size in enumerate(getattr(fake, "shape", ())):
            if isinstance(size, torch.SymInt) and str(size.node.expr) == str(sym.node.expr):
                return t, d
    return None
