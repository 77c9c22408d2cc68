"""The shared graph memory pool: one per platform, every capture of the process in it."""

from __future__ import annotations

import weakref
from typing import Any

from ostinato.platform import Platform, current_platform

_shared_pools: weakref.WeakKeyDictionary[Platform, Any] = weakref.WeakKeyDictionary()


def shared_pool(platform: Platform | None = None) -> Any:
    """The process-wide graph pool of ``platform`` (default: current; None on CPU).

    Every graph captured into it may reuse the memory of every other: only one graph
    replays at a time, so their intermediates never need to coexist. The same platform
    always gets the same pool.
    """
    platform = platform or current_platform()
    if platform not in _shared_pools:
        _shared_pools[platform] = platform.graph_pool_handle()
    return _shared_pools[platform]


def release_shared_pool(platform: Platform | None = None) -> None:
    """Forgets the process-wide pool of ``platform``: the next capture starts a new one.
    Destroy every graph captured into the old pool first; its memory returns to the
    device once nothing holds it (``empty_cache``)."""
    _shared_pools.pop(platform or current_platform(), None)
