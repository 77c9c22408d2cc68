"""Benchmarks, profiles and device scripts of ostinato (not installed): run from the
repository root, e.g. ``python -m benchmarks decode --help``."""

DEFAULT_SHAPE = "llama-1.5b"
"""The random-weight model shape (``ostinato.engine.model.presets.SHAPES``) that the decode
and end-to-end benchmarks time when no shape, config or model is named."""
