"""The engine's arguments: the groups ``LLM`` takes (``CacheArgs``, ``GraphArgs``,
``ParallelArgs``; speculation and kernels travel as ``SpeculativeConfig`` and
``KernelOptions``), and the checks of each value, shared by ``LLM`` and the command line,
so that a bad value is refused with the option's name before anything is loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from ostinato.engine.api.prompts import model_len
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.kernels.options import KernelOptions
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.spec.speculative import SpeculativeConfig
from ostinato.modes import GraphMode
from ostinato.replay_check import DEFAULT_EVERY
from ostinato.ubatch.policy import MicroBatching

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """The device to run on (default: CUDA when available, else CPU); ``ValueError``
    names a device PyTorch does not know or one this machine lacks."""
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device: {spec!r} is not a device PyTorch knows; use cpu, cuda or cuda:N"
        ) from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device: {device.type!r} is not supported by the engine; use cpu or cuda")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device: {spec!r} asked for, but CUDA is not available here (torch "
            f"{torch.__version__}); use --device cpu or a CUDA build of torch on a GPU machine"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"device: {spec!r} does not exist; this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )
    return device


def resolve_dtype(
    spec: torch.dtype | str | None,
    device: torch.device,
    preferred: torch.dtype | None = None,
) -> torch.dtype:
    """The weights' dtype. Default: float32 on CPU; on CUDA the checkpoint's ``preferred``
    dtype when it has one (GGUF files: float32, what their dequantized tensors are),
    else bfloat16."""
    if spec is None:
        if device.type != "cuda":
            return torch.float32
        return preferred or torch.bfloat16
    if isinstance(spec, str) and spec in DTYPES:
        return DTYPES[spec]
    if isinstance(spec, torch.dtype) and spec in DTYPES.values():
        return spec
    raise ValueError(f"dtype: {spec!r} not supported; use one of {', '.join(DTYPES)}")


def parse_mode(spec: GraphMode | str) -> GraphMode | None:
    """A graph mode, or None for ``"auto"`` (any case); ``ValueError`` lists the names."""
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        return None
    try:
        return GraphMode.parse(spec)
    except ValueError:
        names = ", ".join(m.lower() for m in GraphMode.__members__)
        raise ValueError(f"mode: unknown graph mode {spec!r}; use auto, {names}") from None


@dataclass(frozen=True)
class CacheArgs:
    """How much the engine holds at once: sequences per step, tokens per step, the longest
    sequence (default: the model's positions), the KV cache's block size and block count
    (default on CUDA: sized from free memory, using at most ``gpu_memory_utilization`` of
    the device)."""

    block_size: int = 16
    max_num_seqs: int = 32
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9


@dataclass(frozen=True)
class GraphArgs:
    """Which graphs: ``mode`` (a ``GraphMode`` or its name; ``"auto"``: FULL_AND_PIECEWISE
    on CUDA, NONE on the CPU), the capture sizes (default: the ladder up to
    ``max_capture_size``), and ``compiler`` for the pieces (``"inductor"``, ``"eager"``,
    None for no compilation, ``"auto"``: Inductor where the mode needs pieces, on CUDA),
    and when to ``capture``: ``"blocking"`` (every graph before the engine returns) or
    ``"background"`` (the engine returns once its weights and KV cache are ready; steps
    run eagerly, or replay what is ready, while a thread compiles and captures).
    ``verify``: ``"capture"`` checks each FULL graph against eager at capture (padding
    rows given other tokens must leave the real rows bitwise the same), ``"sample"`` one
    replay in ``verify_every`` while serving; a graph that differs is demoted to eager
    (``ostinato.replay_check``)."""

    mode: GraphMode | str = "auto"
    capture_sizes: tuple[int, ...] | None = None
    max_capture_size: int = 512
    compiler: str | None = "auto"
    capture: str = "blocking"
    verify: str = "off"
    verify_every: int = DEFAULT_EVERY


@dataclass(frozen=True)
class ParallelArgs:
    """Tensor and data parallelism: the sizes, the all-reduce (``"auto"``, ``"nccl"``,
    ``"one-shot"``, ``"two-shot"``), and micro-batch overlap (``True`` for the default
    policy, or a ``MicroBatching``)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    all_reduce: str = "auto"
    micro_batching: MicroBatching | bool = False


GROUPS: tuple[type, ...] = (CacheArgs, GraphArgs, ParallelArgs)


def group_arguments(
    cache: CacheArgs | None,
    graphs: GraphArgs | None,
    parallel: ParallelArgs | None,
    keywords: dict[str, Any],
) -> tuple[CacheArgs, GraphArgs, ParallelArgs]:
    """The three groups, each field given as a plain keyword (``max_model_len=``,
    ``mode=``, ``tensor_parallel_size=``, ...) put into its group. ``TypeError`` names a
    group of the wrong type, a keyword no group has, and a field given both ways."""
    given = [cache, graphs, parallel]
    for i, (group, cls) in enumerate(zip(given, GROUPS, strict=True)):
        if group is None:
            given[i] = cls()
        elif not isinstance(group, cls):
            raise TypeError(f"expected a {cls.__name__}, got {type(group).__name__}")
    owner = {f.name: i for i, cls in enumerate(GROUPS) for f in fields(cls)}
    updates: list[dict[str, Any]] = [{}, {}, {}]
    for name, value in keywords.items():
        if name not in owner:
            known = ", ".join(sorted(owner))
            raise TypeError(f"LLM: unexpected keyword argument {name!r}; the grouped ones: {known}")
        i = owner[name]
        cls = GROUPS[i]
        if (cache, graphs, parallel)[i] is not None:
            raise TypeError(f"{name}: given as a keyword and in a {cls.__name__} too; give it once")
        updates[i][name] = value
    return tuple(replace(g, **u) for g, u in zip(given, updates, strict=True))  # type: ignore[return-value]


def parse_speculative(
    speculative: SpeculativeConfig | str | None, num_speculative_tokens: int
) -> SpeculativeConfig | None:
    """The speculation asked for: a ``SpeculativeConfig``, or its string form
    (``"ngram"``, ``"self:N"``) with ``num_speculative_tokens`` drafts per step."""
    if isinstance(speculative, str):
        return SpeculativeConfig.parse(speculative, num_speculative_tokens)
    if not isinstance(speculative, (SpeculativeConfig, type(None))):
        raise TypeError(
            f"speculative: expected 'ngram', 'self:N' or a SpeculativeConfig, got "
            f"{type(speculative).__name__}"
        )
    return speculative


def kernel_options(kernels: KernelOptions | None) -> KernelOptions:
    """``kernels``, or the defaults; ``TypeError`` for anything else."""
    if not isinstance(kernels, (KernelOptions, type(None))):
        raise TypeError(f"kernels: expected a KernelOptions, got {type(kernels).__name__}")
    return kernels or KernelOptions()


# Modes whose micro-batched steps run without compiled code (eagerly, or in FULL graphs
# of the eager kernels).
_MICRO_BATCH_MODES = (GraphMode.NONE, GraphMode.FULL, GraphMode.FULL_DECODE_ONLY)


CAPTURE_WHEN = ("blocking", "background")


def check_capture(
    graphs: GraphArgs, parallel: ParallelArgs, speculative: SpeculativeConfig | None
) -> bool:
    """Whether graphs are captured in the background (``GraphArgs.capture``); refuses,
    naming why, an unknown value and what background capture does not cover: several
    ranks (each would capture in its own order, and graphs holding collectives must be
    captured in step), micro-batching (it times its captures), self-drafting or oracle
    speculation (their graphs and lookahead state are captured at start-up), and the
    capture check (its replays would overwrite a running step's outputs)."""
    capture = graphs.capture
    if capture not in CAPTURE_WHEN:
        raise ValueError(f"capture: 'blocking' or 'background', got {capture!r}")
    if capture == "blocking":
        return False
    if graphs.verify == "capture":
        raise ValueError(
            "capture='background': not with verify='capture', whose replays would overwrite "
            "the outputs of steps running meanwhile; use verify='sample' or 'blocking'"
        )
    if parallel.tensor_parallel_size * parallel.data_parallel_size > 1 or (
        parallel.micro_batching is not False
    ):
        raise ValueError(
            "capture='background': not with tensor or data parallelism or micro-batching "
            "(every rank must capture the same graphs in the same order); use 'blocking'"
        )
    if speculative is not None and speculative.method in ("self", "oracle"):
        raise ValueError(
            f"capture='background': not with speculative={speculative.method!r}, whose "
            "draft graphs and lookahead are set up at start-up; use 'blocking' or 'ngram'"
        )
    return True


def micro_batching_policy(
    parallel: ParallelArgs, requested: GraphMode | None
) -> MicroBatching | None:
    """The micro-batching policy asked for (None: off); refuses it, naming why, on one
    GPU and with modes that may compile pieces."""
    asked = parallel.micro_batching
    if not isinstance(asked, (bool, MicroBatching)):
        raise TypeError(
            f"micro_batching: expected a bool or a MicroBatching, got {type(asked).__name__}"
        )
    policy = MicroBatching() if asked is True else asked or None
    if policy is not None and parallel.tensor_parallel_size == 1:
        raise ValueError(
            "micro_batching: needs tensor_parallel_size > 1 (there are no collectives "
            "to overlap on one GPU)"
        )
    if policy is not None and requested not in _MICRO_BATCH_MODES:
        mode = requested.name.lower() if requested else "auto"
        raise ValueError(
            f"micro_batching: not with mode={mode!r}: it may compile pieces, which "
            "trace the all-reduce where the micro-batches must hand over; use "
            "mode='full' or 'full_decode_only' (the overlapped step captured as one "
            "graph per size) or 'none'"
        )
    return policy


MAX_CPU_THREADS = 4


def available_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def limit_cpu_threads(world_size: int) -> int | None:
    """On the CPU, torch's default of one thread per core oversubscribes a machine that
    runs other work, or this engine's own ranks: unless ``OMP_NUM_THREADS`` names a count,
    each rank uses at most ``MAX_CPU_THREADS`` and at most its share of the cores. Returns
    the count set, or None where the user chose."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = max(1, min(MAX_CPU_THREADS, available_cores() // max(1, world_size)))
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
    return threads


def engine_limits(cache: CacheArgs, config: ModelConfig) -> EngineLimits:
    """The step and sequence limits of ``cache`` for a model of ``config`` (``max_model_len``
    checked against its positions); ``ValueError`` names a ``num_blocks`` too small for one
    sequence of ``max_model_len``."""
    max_model_len = model_len(cache.max_model_len, config)
    limits = EngineLimits(
        cache.max_num_seqs,
        cache.max_num_batched_tokens or max(max_model_len, 2048),
        max_model_len,
        cache.block_size,
    )
    num_blocks = cache.num_blocks
    if num_blocks is not None and num_blocks - 1 < limits.blocks_per_seq:
        raise ValueError(
            f"num_blocks: {num_blocks} blocks (one is the null block) cannot hold one "
            f"sequence of max_model_len={max_model_len} ({limits.blocks_per_seq} blocks); "
            "raise num_blocks or lower max_model_len"
        )
    return limits
