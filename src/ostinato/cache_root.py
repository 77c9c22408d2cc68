"""Where ostinato keeps what it makes once and reuses across processes (compiled
functions, converted models, compiled pieces, tuned plans, bytecode): one root folder,
found without importing torch, so that a command line finds it before anything heavy is
imported."""

from __future__ import annotations

import contextlib
import os
import uuid
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


def root_from_arg(cache_dir: object) -> Path | None:
    """The root a ``cache_dir`` argument asks for: None or True the default
    (``default_cache_root``), a path that folder, False none (no cache); ``TypeError``
    naming ``cache_dir`` for anything else."""
    if cache_dir is False:
        return None
    if cache_dir is None or cache_dir is True:
        return default_cache_root()
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(
            f"cache_dir: expected a path, True, False or None, got {type(cache_dir).__name__}"
        )
    return Path(cache_dir)


def replace_file(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary name beside it, then a rename: a
    reader sees the old file or the new one, never half of one, and of two writers one
    wins whole. ``OSError`` where it cannot (the temporary file removed first)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
