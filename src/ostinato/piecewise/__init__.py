"""Piecewise graphs: a torch.compile backend that splits the model at attention."""

from ostinato.piecewise.backend import (
    DEFAULT_SPLITTING_OPS,
    CompiledModel,
    CompileStats,
    PiecewiseBackend,
)
from ostinato.piecewise.split import NoSplittingOpError, Piece, SplitGraph, split_graph

__all__ = [
    "DEFAULT_SPLITTING_OPS",
    "CompileStats",
    "CompiledModel",
    "NoSplittingOpError",
    "Piece",
    "PiecewiseBackend",
    "SplitGraph",
    "split_graph",
]
