"""Wall time of wrapped calls, for the profiling scripts beside this file (imports nothing
heavy, so a script may import it before it sets up torch's environment)."""

from __future__ import annotations

import time
from collections import defaultdict


class WallTimers:
    """Wraps callables so each call's wall seconds land in ``spans[name]`` (a call nested
    in another wrapped call counts in both)."""

    def __init__(self) -> None:
        self.spans: dict[str, list[float]] = defaultdict(list)

    def wrap(self, obj: object, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.spans[name].append(time.perf_counter() - t)

        setattr(obj, attr, timed)
