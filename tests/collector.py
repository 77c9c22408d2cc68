"""What the cyclic collector would walk: the freeze checks shared by the CPU and GPU
tests of a start's heap (``ostinato.engine.core.heap``)."""

from __future__ import annotations

import gc
from collections.abc import Iterable


def walked(objects: Iterable[object]) -> list[object]:
    """Those of ``objects`` that a full collection walks: every object the collector
    tracks but the permanent generation's (``gc.freeze``)."""
    tracked = {id(o) for o in gc.get_objects()}
    return [o for o in objects if id(o) in tracked]
