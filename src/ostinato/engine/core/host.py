"""What the host gives this process: its cores."""

from __future__ import annotations

import os


def available_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
