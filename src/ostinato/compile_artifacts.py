"""Compiled functions kept across processes: ``torch.compile``'s ahead-of-time path saves
Dynamo's trace and the compiler's output as one artifact, and the next process loads it
instead of tracing and compiling again.

An artifact is a file under ``<cache root>/compiled`` named by a key of everything the
compilation depended on: the torch and Python versions, the device, the compiler, the
family of call signatures it serves, and the function itself (a module's class, its
architecture and the names, shapes and dtypes of its parameters and buffers; a plain
function's qualified name and code, and what a closure captured). A family may hold
several artifacts (Dynamo specializes a batch of one, for instance), each tried in turn.

Guarantees: an artifact runs a call only where its guards accept the call (the check
Dynamo makes before reusing compiled code in one process, less the guards it cannot save
and those on globals: ``savable_guards``) and where every source it was traced from
reads as it did (an edited ``forward`` is compiled anew); a function
without a stable identity (a closure over a tensor, an FX graph) keeps nothing; an
artifact that cannot be used (corrupt, made by another torch, or from older source) is
named in a warning, removed and made again; a folder that cannot be written is a
warning, and nothing is kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import logging
import os
import platform
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ostinato.cache_root import root_from_arg

logger = logging.getLogger(__name__)

FOLDER = "compiled"
SUFFIX = ".aot"
MAX_PER_KEY = 8
"""Artifacts kept under one key at most: each process whose calls no kept artifact's
guards accept (another thread count, say) adds one, and the folder must not grow for
ever."""


def supported() -> bool:
    """Whether this torch can save and load compiled functions."""
    return hasattr(torch.compiler, "load_compiled_function")


def enabled() -> contextlib.AbstractContextManager[object]:
    """Where this torch gates ahead-of-time compilation behind Dynamo's config (torch
    2.11 does; later ones need nothing), the context that opens the gate."""
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        return torch._dynamo.config.patch(enable_aot_compile=True)
    return contextlib.nullcontext()


def savable_guards(entries: list[Any]) -> list[bool]:
    """Dynamo's guard filter (``guard_filter_fn``) for a function compiled to be kept:
    every guard but two kinds. Those Dynamo cannot save check the identity of objects
    the trace reached (the function a module holds as its activation, the code of a
    method whose signature a model reads): kept, they made such a function unsavable
    ("ID_MATCH guard cannot be serialized"), and a closure over a transformers model
    kept nothing. Those on globals (a library's registries and flags, the interpreter's
    hooks) name the traced frames' globals by aliases a loading process does not have.
    The key and the source check stand for both: ``identity`` names each function a
    module holds, ``changed_source`` checks the code of every function the trace
    inlined. Left unchecked: a library global changed between processes (an attention
    function registered anew, say). Tensor, shape and grad-mode guards all stay."""
    unsavable = set(_unsavable_guard_types())
    return [
        not ({e.guard_type, *e.derived_guard_types} & unsavable or e.is_global) for e in entries
    ]


def _unsavable_guard_types() -> tuple[str, ...]:
    from torch._dynamo.guards import CheckFunctionManager

    return CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES


def identity(fn: Any) -> list[str] | None:
    """What names ``fn``'s code across processes, or None where nothing does: a module's
    class, architecture and parameter and buffer shapes (not values: they are read at
    each call); a function's qualified name, line and bytecode, and for a closure (a
    lambda too) the identity of each captured value, which may be a module, a function
    or a constant (None for anything else: a tensor, say, whose value Dynamo may bake
    in); a bound method's object and function. An FX ``GraphModule`` has none: its code
    is generated, not named."""
    if isinstance(fn, torch.fx.GraphModule):
        return None
    if isinstance(fn, torch.nn.Module):
        kind = type(fn)
        tensors = [
            f"{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type}"
            for name, t in [*fn.named_parameters(), *fn.named_buffers()]
        ]
        return [f"{kind.__module__}.{kind.__qualname__}", repr(fn), *tensors, *_held(fn)]
    if inspect.ismethod(fn):
        owner, func = identity(fn.__self__), identity(fn.__func__)
        return None if owner is None or func is None else [*owner, *func]
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return None
    named = [f"{fn.__module__}.{fn.__qualname__}:{code.co_firstlineno}", _code_digest(code)]
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
        try:
            captured = _captured(cell.cell_contents)
        except ValueError:  # (a cell not yet filled)
            return None
        if captured is None:
            return None
        named += [f"{name}=", *captured]
    return named


def _held(module: torch.nn.Module) -> list[str]:
    """The functions ``module`` and its submodules hold as attributes (an activation,
    say), by qualified name: a trace calls them, and its guard on which one it was
    cannot be kept (``savable_guards``)."""
    return [
        f"{path}.{attr}={getattr(v, '__module__', None)}.{getattr(v, '__qualname__', v)}"
        for path, m in module.named_modules()
        for attr, v in vars(m).items()
        if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodType))
    ]


def _captured(value: Any) -> list[str] | None:
    """The identity of a value a closure captured (see ``identity``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return [repr(value)]  # (constants: Dynamo bakes them into the trace)
    return identity(value)


def _code_digest(code: types.CodeType) -> str:
    """A digest of ``code``'s bytecode and constants, nested code objects by their own
    digest (their repr carries an address, which differs in every process)."""
    parts = [code.co_code]
    for const in code.co_consts:
        is_code = isinstance(const, types.CodeType)
        parts.append(_code_digest(const).encode() if is_code else repr(const).encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()


def artifact_key(fn: Any, family: Any, compiler: str, device: torch.device) -> str | None:
    """The key of ``fn``'s compilation by ``compiler`` for call signature ``family`` on
    ``device``; None where ``fn`` has no stable identity."""
    named = identity(fn)
    if named is None:
        return None
    where = [device.type]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where += [props.name, f"{props.major}.{props.minor}"]
    parts = [torch.__version__, sys.version, platform.machine(), compiler, *where]
    parts += [repr(family), *named]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


class ArtifactStore:
    """The artifacts under ``root/compiled`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.folder = Path(root).expanduser() / FOLDER
        self._warned = False

    @classmethod
    def from_arg(cls, cache_dir: object) -> ArtifactStore | None:
        """The store ``cache_dir`` asks for (``cache_root.root_from_arg``), or None."""
        root = root_from_arg(cache_dir)
        return None if root is None else cls(root)

    def load(self, key: str) -> list[Callable[..., Any]]:
        """Every artifact kept under ``key``, loaded, in the order they were made; one
        that cannot be loaded is named in a warning and removed."""
        found = []
        for path in sorted(self.folder.glob(f"{key}-*{SUFFIX}"), key=_index):
            try:
                with path.open("rb") as f:
                    compiled = torch.compiler.load_compiled_function(f)
                changed = changed_source(compiled)
                if changed is not None:
                    raise ValueError(f"made from another version of {changed}")
                found.append(compiled)
            except Exception as exc:  # any failure to load is a stale or broken file
                warnings.warn(
                    f"ostinato: compiled function {path} cannot be used "
                    f"({type(exc).__name__}: {exc}); removed, it will be compiled again",
                    stacklevel=2,
                )
                path.unlink(missing_ok=True)
        return found

    def save(self, key: str, index: int, compiled: Any) -> bool:
        """Keeps ``compiled`` (an ahead-of-time compiled function) as artifact ``index``
        of ``key``; False, with one warning per store, where it cannot be written, and
        False where ``key`` holds ``MAX_PER_KEY`` already."""
        if index >= MAX_PER_KEY:
            logger.info("ostinato: %s holds %d compiled functions; not kept", key, index)
            return False
        path = self.folder / f"{key}-{index}{SUFFIX}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(path))
        except Exception as exc:  # an unwritable folder, or a function torch cannot save
            if not self._warned:
                warnings.warn(
                    f"ostinato: compiled function not kept in {self.folder} "
                    f"({type(exc).__name__}: {exc}); the next process compiles again",
                    stacklevel=2,
                )
                self._warned = True
            return False
        logger.info("ostinato: compiled function kept in %s", path)
        return True


def changed_source(compiled: Any) -> str | None:
    """The first source ``compiled`` was traced from that reads differently now (its
    module and lines), or None: Dynamo records a checksum of every function it inlined,
    which its guards do not check."""
    for code in sorted(compiled.source_info().inlined_sources, key=lambda c: c.module):
        lines = inspect.getsourcelines(importlib.import_module(code.module))[0]
        now = "".join(lines[code.firstlineno - 1 : code.lastlineno - 1])
        if hashlib.sha256(now.encode()).hexdigest() != code.checksum:
            return f"{code.module} (lines {code.firstlineno}-{code.lastlineno})"
    return None


def _index(path: Path) -> int:
    return int(path.stem.rpartition("-")[2])
