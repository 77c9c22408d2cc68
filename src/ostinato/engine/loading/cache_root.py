"""Where ostinato keeps what it makes once and reuses across processes (converted models,
compiled pieces, tuned plans, bytecode): one root folder, importable without torch so
that the command line can find it before anything heavy is imported."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "OSTINATO_CACHE_DIR"


def default_cache_root() -> Path:
    """``$OSTINATO_CACHE_DIR``, else the platform's user cache folder for ostinato."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("ostinato", appauthor=False))
