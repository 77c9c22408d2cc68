"""Splitting an FX graph at opaque ops (attention) into pieces that can be graphed."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.split_module import split_module


class NoSplittingOpError(ValueError):
    """The graph contains none of the splitting ops, so piecewise capture cannot help."""


@dataclass(frozen=True)
class Piece:
    """One submodule of the split graph, in execution order.

    ``is_splitting_op``: the piece is a single splitting op (runs eagerly, never graphed).
    ``source``: the user source line of the piece's first op, for error messages.
    """

    name: str
    is_splitting_op: bool
    ops: tuple[str, ...]
    source: str


@dataclass
class SplitGraph:
    """The split module and its pieces in execution order."""

    module: fx.GraphModule
    pieces: list[Piece]

    @property
    def graphable(self) -> list[Piece]:
        """The pieces that are not splitting ops."""
        return [p for p in self.pieces if not p.is_splitting_op]


def normalize_op_name(name: str) -> str:
    """``ostinato::attention`` and ``ostinato.attention.default`` -> ``ostinato.attention``."""
    name = name.replace("::", ".")
    for suffix in (".default",):
        name = name.removesuffix(suffix)
    return name


def op_name(node: fx.Node) -> str:
    """The normalised op name of a call_function node, else ''."""
    return normalize_op_name(str(node.target)) if node.op == "call_function" else ""


def split_graph(gm: fx.GraphModule, splitting_ops: Sequence[str]) -> SplitGraph:
    """Splits ``gm`` so every call of a splitting op is a piece of its own.

    Raises ``NoSplittingOpError`` naming the ops that were asked for and the custom ops
    that the graph does contain.
    """
    wanted = {normalize_op_name(s) for s in splitting_ops}
    partition: dict[fx.Node, int] = {}
    current = 0
    found = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if op_name(node) in wanted:
            current += 1
            partition[node] = current
            current += 1
            found += 1
        elif _takes_an_output_of(node, wanted):
            partition[node] = partition[node.args[0]]  # stays with its op: no piece of its own
        else:
            partition[node] = current
    if not found:
        custom = sorted(
            {
                op_name(n)
                for n in gm.graph.nodes
                if isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
                and not op_name(n).startswith(("aten.", "prims."))
            }
        )
        raise NoSplittingOpError(
            f"no splitting op {sorted(wanted)} found in the compiled graph "
            f"(custom ops present: {custom or 'none'}). Piecewise graphs split the model at "
            "attention: register attention as a custom op (torch.library) and name it in "
            "splitting_ops, or use FULL graphs."
        )
    split = split_module(gm, None, lambda n: partition[n], keep_original_order=True)
    pieces = []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        ops = tuple(
            op_name(n) or str(n.target)
            for n in sub.graph.nodes
            if n.op in ("call_function", "call_method", "call_module")
        )
        calls = [o for o in ops if o != str(operator.getitem)]
        is_split = len(calls) == 1 and normalize_op_name(calls[0]) in wanted
        pieces.append(Piece(node.target, is_split, ops, _source(sub)))
    return SplitGraph(split, pieces)


def _takes_an_output_of(node: fx.Node, wanted: set[str]) -> bool:
    """``node`` picks one output of a splitting op that returns several."""
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and op_name(node.args[0]) in wanted
    )


def _source(gm: fx.GraphModule) -> str:
    for n in gm.graph.nodes:
        trace = n.meta.get("stack_trace")
        if trace:
            lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
            # The last "File ..., line N" entry and the code line after it.
            for i in range(len(lines) - 1, -1, -1):
                if lines[i].startswith("File "):
                    code = lines[i + 1] if i + 1 < len(lines) else ""
                    return f"{lines[i]}: {code}"
    return "unknown source"
