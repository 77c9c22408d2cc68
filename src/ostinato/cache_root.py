"""Where ostinato keeps what it makes once and reuses across processes (compiled
functions, converted models, compiled pieces, tuned plans, bytecode): one root folder,
found without importing torch, so that a command line finds it before anything heavy is
imported."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "OSTINATO_CACHE_DIR"


def default_cache_root() -> Path:
    """``$OSTINATO_CACHE_DIR``, else ``ostinato`` in the user's cache folder
    (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "ostinato"
