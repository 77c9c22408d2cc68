"""Micro-batch overlap: a step split into two micro-batches run on two threads that take
turns, so one's collective overlaps the other's compute; run eagerly or captured in one
FULL graph, split only where a capture-time measurement says it is faster."""
