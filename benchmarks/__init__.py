"""Benchmarks, profiles and device scripts of ostinato (not installed): run from the
repository root, e.g. ``python -m benchmarks decode --help``."""

from ostinato.engine.model.presets import SHAPES

DEFAULT_SHAPE = "llama-1.5b"
"""The random-weight model shape (``ostinato.engine.model.presets.SHAPES``) that the decode
and end-to-end benchmarks time when no shape, config or model is named."""

TIMED_SHAPES = tuple(name for name in SHAPES if name != "tiny")
"""The preset shapes a decode-step timing takes (``tiny`` checks that a run works, nothing
more: its step is launch overhead alone)."""
