"""Micro-batch overlap: a step split into two micro-batches run on two threads that take
turns, so one's collective overlaps the other's compute (GPU integration: not yet)."""
