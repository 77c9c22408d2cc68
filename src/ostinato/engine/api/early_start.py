"""What an engine's process starts on threads before it imports torch, where the engine
will run on a GPU: the device's CUDA context (``ostinato.early_context``) and Triton's
once-a-process set-up (``kernels.triton_warmup``), after pointing Triton at the engine's
compile cache, where that set-up keeps what it builds; on one GPU with that cache empty,
the kernels' compile workers too (``compile_pool.start_for_a_cold_cache``). Imports
neither torch nor Triton."""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from pathlib import Path

from ostinato import early_context
from ostinato.cache_root import root_from_arg
from ostinato.engine.kernels import compile_pool, triton_warmup
from ostinato.engine.worker.compile_cache import CompileCache


def start_early(
    device: object,
    world_size: int = 1,
    cache_dir: object = None,
    environ: Mapping[str, str] = os.environ,
) -> bool:
    """Starts both for an engine whose ``device`` is this (a string, a ``torch.device``
    or None, the engine's default), whose ranks number ``world_size`` and whose
    ``cache_dir`` (its ``EngineArgs`` field) is this, on the GPU this process's rank will
    use; False where that is no CUDA device or not known. Where the engine has a cache,
    Triton's and Inductor's folders are pointed into it first, as the engine does (an
    empty-cache start otherwise built Triton's helper module twice: on the thread, into
    Triton's default folder, and again at the first launch, into the engine's)."""
    index = early_context.device_index(device)
    if index is None or not torch_has_cuda():
        return False
    try:
        root = root_from_arg(cache_dir)
    except TypeError:
        root = None  # (the engine refuses it by name)
    if root is not None:
        CompileCache(root).point_compilers_here()
    if environ.get("WORLD_SIZE") not in (None, "1"):
        # A rank torchrun started: its GPU is its local rank's (distributed.groups).
        local = environ.get("LOCAL_RANK", "")
        if not local.isdigit():
            return False
        index = int(local)
    elif world_size > 1:
        index = 0  # (rank 0 is this process, on the host's first GPU; it starts the rest)
    else:  # (one process: its compile workers, where every kernel will compile)
        compile_pool.start_for_a_cold_cache(environ)
    early_context.start(index, also=triton_warmup.warm)
    return True


def torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build, read from its ``version.py`` without
    importing it (a CPU build on a machine with a GPU runs the engine on the CPU: a
    context made there would hold the GPU's memory for nothing)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return False
    return re.search(r"^cuda\b[^=\n]*=\s*['\"]", text, re.MULTILINE) is not None
