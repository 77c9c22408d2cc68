"""The model cache: a converted checkpoint kept on disk so that later loads map it.

A source that needs conversion (a GGUF file: parsed, dequantized, its q/k rows
unpermuted, its tokenizer built from 442k metadata parts) is converted once; the entry
holds the weights as safetensors in the dtype the engine runs, the config, the EOS tokens
and the tokenizer (``tokenizer.json`` and its chat template), with a manifest written
last that records the checksum of every file.

Guarantees:

- An entry is keyed by the source's identity (resolved path, size, mtime and a hash of
  its first MiB), the dtype, the ostinato version and the entry format; a change to any
  of them is a miss, never a stale load.
- ``lookup`` verifies sizes and checksums before it returns an entry; a corrupt,
  truncated or foreign entry is named in a warning, removed and reported as a miss.
- ``store`` writes into a temporary folder and renames it into place: a reader never
  sees half an entry, and of two processes filling the same entry one wins and both
  leave one valid entry. A directory that cannot be written (read-only, full) logs a
  warning and the load goes on without a cache.

Where the cache lives: the ``cache_dir`` argument, else ``$OSTINATO_CACHE_DIR``, else
the platform's user cache folder (``~/.cache/ostinato`` on Linux).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ostinato import __version__
from ostinato.cache_root import ENV_VAR, root_from_arg
from ostinato.engine.core.host import available_cores
from ostinato.engine.model.config import ModelConfig, RopeScaling

if TYPE_CHECKING:  # (torch is not imported here: its dtypes are only named)
    import torch

logger = logging.getLogger(__name__)

# Writes a tokenizer's files into the folder it is given.
SaveTokenizer = Callable[[Path], None]
FORMAT = 2  # bump when an entry's layout or meaning changes (2: a CRC-32 per piece)
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer"
MANIFEST = "manifest.json"
_HEADER_BYTES = 1 << 20
PIECE_BYTES = 64 << 20  # a checksum's piece: a thread's share of a large file
CHECKSUM_THREADS = min(8, available_cores())

CacheDirArg = str | Path | bool | None
"""``None``/``True``: the default location; a path: that folder; ``False``: no cache."""


def source_identity(path: Path) -> dict[str, Any]:
    """What a source file's entry depends on: resolved path, size, mtime, header hash."""
    resolved = path.resolve()
    st = resolved.stat()
    with open(resolved, "rb") as f:
        header = hashlib.sha256(f.read(_HEADER_BYTES)).hexdigest()
    return {
        "path": str(resolved),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "header_sha256": header,
    }


def file_checksum(path: Path) -> str:
    """The CRC-32 of each ``PIECE_BYTES`` of a file, side by side, computed on up to
    ``CHECKSUM_THREADS`` threads (zlib lets go of the interpreter lock): one thread's CRC
    runs at 1.4-1.7 GB/s on an H200's host, 0.3 s of every cached SmolLM2 start (540 MB)
    before the weights load (at that rate, some 10 s for an 8 B entry)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return "crc32:00000000"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as view:
            starts = range(0, size, PIECE_BYTES)
            with ThreadPoolExecutor(min(CHECKSUM_THREADS, len(starts))) as pool:
                crcs = list(pool.map(lambda at: zlib.crc32(view[at : at + PIECE_BYTES]), starts))
    return "crc32:" + ",".join(f"{c:08x}" for c in crcs)


@dataclass(frozen=True)
class CachedModel:
    """A verified entry: its folder (weights in ``weights``, tokenizer folder in
    ``tokenizer_dir`` or None), the config and EOS tokens it was made with."""

    folder: Path
    config: ModelConfig
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype

    @property
    def weights(self) -> Path:
        return self.folder / WEIGHTS

    @property
    def tokenizer_dir(self) -> Path | None:
        d = self.folder / TOKENIZER
        return d if d.is_dir() else None


class ModelCache:
    """Entries under ``root/models`` (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    @classmethod
    def from_arg(cls, cache_dir: CacheDirArg) -> ModelCache | None:
        """The cache ``cache_dir`` asks for (see ``CacheDirArg``), or None for no cache."""
        root = root_from_arg(cache_dir)
        return None if root is None else cls(root)

    def _key(self, identity: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
        return {"format": FORMAT, "ostinato": __version__, "dtype": _dtype_name(dtype), **identity}

    def entry_path(self, source: Path, dtype: torch.dtype) -> Path:
        """The folder the entry of ``source`` in ``dtype`` has (whether or not it exists)."""
        return self._entry_path(self._key(source_identity(source), dtype))

    def _entry_path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.root / "models" / f"{Path(key['path']).stem}-{digest}"

    def lookup(self, source: Path, dtype: torch.dtype) -> CachedModel | None:
        """The verified entry for ``source`` in ``dtype``, or None (a miss; a bad entry
        is named in a warning and removed)."""
        key = self._key(source_identity(source), dtype)
        folder = self._entry_path(key)
        if not folder.is_dir():
            return None
        manifest, problem = _read_manifest(folder)
        if manifest is not None:
            problem = _check_entry(folder, key, manifest)
        if problem is None:
            try:
                return CachedModel(
                    folder,
                    _config_from_dict(manifest["config"]),
                    tuple(manifest["eos_token_ids"]),
                    dtype,
                )
            except (KeyError, TypeError, ValueError) as exc:
                problem = f"its manifest cannot be read ({exc})"
        logger.warning(
            "ostinato: model cache entry %s is %s; removing it and converting %s again",
            folder, problem, source,
        )  # fmt: skip
        _remove(folder)
        return None

    def store(
        self,
        source: Path,
        dtype: torch.dtype,
        config: ModelConfig,
        eos_token_ids: tuple[int, ...],
        tensors: dict[str, torch.Tensor],
        save_tokenizer: SaveTokenizer | None,
    ) -> Path | None:
        """Writes the entry of ``source`` (``tensors`` in HF names, already in ``dtype``;
        ``save_tokenizer`` writes the tokenizer's files into the folder it is given, after
        the weights) and returns its folder; None, with a warning, when the cache cannot
        be written."""
        key = self._key(source_identity(source), dtype)
        final = self._entry_path(key)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            _write_entry(tmp, key, config, eos_token_ids, tensors, save_tokenizer)
            _publish(tmp, final)
        except OSError as exc:
            _remove(tmp)
            logger.warning(
                "ostinato: cannot write the model cache at %s (%s); running without it "
                "(set %s or --cache-dir to a writable folder, or --no-cache)",
                self.root, exc, ENV_VAR,
            )  # fmt: skip
            return None
        except BaseException:
            _remove(tmp)  # (the tokenizer's failure, say: the caller's to report)
            raise
        self._prune_siblings(final, key["path"])
        return final

    def _prune_siblings(self, kept: Path, source_path: str) -> None:
        # Entries of the same file made before it changed (or by another version) are
        # never looked up again.
        for other in kept.parent.glob(f"{kept.name.rsplit('-', 1)[0]}-*"):
            if other == kept or other.name.startswith(".tmp-"):
                continue
            try:
                manifest = json.loads((other / MANIFEST).read_text())
            except (OSError, ValueError):
                continue
            if manifest.get("key", {}).get("path") == source_path:
                _remove(other)


def _write_entry(
    folder: Path,
    key: dict[str, Any],
    config: ModelConfig,
    eos_token_ids: tuple[int, ...],
    tensors: dict[str, torch.Tensor],
    save_tokenizer: SaveTokenizer | None,
) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS))
    if save_tokenizer is not None:
        save_tokenizer(folder / TOKENIZER)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {
        "key": key,
        "config": _config_to_dict(config),
        "eos_token_ids": list(eos_token_ids),
        "files": {
            str(p.relative_to(folder)): {"size": p.stat().st_size, "checksum": file_checksum(p)}
            for p in files
        },
    }
    # Written last: an entry without a manifest is incomplete.
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _publish(tmp: Path, final: Path) -> None:
    """Renames ``tmp`` to ``final``; if another process published first, keeps theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if (final / MANIFEST).is_file():
            _remove(tmp)  # another writer won; its entry is as good as ours
            return
        raise


def _read_manifest(folder: Path) -> tuple[Any, str | None]:
    """The entry's manifest, or None and what is wrong with it, for the warning."""
    try:
        return json.loads((folder / MANIFEST).read_text()), None
    except FileNotFoundError:
        return None, "incomplete (no manifest)"
    except (OSError, ValueError) as exc:
        return None, f"unreadable ({exc})"


def _check_entry(folder: Path, key: dict[str, Any], manifest: Any) -> str | None:
    """None if the entry at ``folder`` (its ``manifest`` read) is complete and intact for
    ``key``; else what is wrong with it, for the warning."""
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return "stale (made for another version, dtype or source)"
    files = manifest.get("files")
    if not isinstance(files, dict) or WEIGHTS not in files:
        return "incomplete (its manifest lists no weights)"
    for name, expected in files.items():
        p = folder / name
        if not p.is_file():
            return f"incomplete ({name} is missing)"
        size = p.stat().st_size
        if size != expected.get("size"):
            return f"truncated ({name} has {size} bytes, expected {expected.get('size')})"
        if file_checksum(p) != expected.get("checksum"):
            return f"corrupt ({name} fails its checksum)"
    return None


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _config_to_dict(config: ModelConfig) -> dict[str, Any]:
    return asdict(config)


def _config_from_dict(data: dict[str, Any]) -> ModelConfig:
    scaling = data.get("rope_scaling")
    return ModelConfig(**{**data, "rope_scaling": RopeScaling(**scaling) if scaling else None})
