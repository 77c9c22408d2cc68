"""Benchmarks, profiles and device scripts of ostinato (not installed): run from the
repository root, e.g. ``python -m benchmarks decode --help``."""
