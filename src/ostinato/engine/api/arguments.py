"""The checks of the engine's options (``engine_args.EngineArgs``), shared by ``LLM`` and
the command line, so that a bad value is refused with the option's name before anything
is loaded."""

from __future__ import annotations

import os
from dataclasses import fields, replace

import torch

from ostinato.config import check_one_ladder
from ostinato.engine.api.engine_args import (
    CacheArgs,
    EngineArgs,
    GraphArgs,
    LoraArgs,
    ParallelArgs,
    lora_module,
)
from ostinato.engine.api.prompts import model_len
from ostinato.engine.core.host import available_cores
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.spec.speculative import SpeculativeConfig
from ostinato.modes import GraphMode
from ostinato.ubatch.policy import MicroBatching

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


# Modes whose micro-batched steps run without compiled code (eagerly, or in FULL graphs
# of the eager kernels).
_MICRO_BATCH_MODES = (GraphMode.NONE, GraphMode.FULL, GraphMode.FULL_DECODE_ONLY)


CAPTURE_WHEN = ("auto", "blocking", "background", "staged")


def check_capture(
    graphs: GraphArgs,
    parallel: ParallelArgs,
    speculative: SpeculativeConfig | None,
    mode: GraphMode | None,
) -> str:
    """``GraphArgs.capture``, checked: refuses, naming why, an unknown value and, for
    capture in the background or staged, several ranks (each would capture in its own
    order, and graphs holding collectives must be captured in step), micro-batching (it
    times its captures), self-drafting speculation (its draft graphs are captured at
    start-up) and the capture check (its replays would overwrite a running step's
    outputs); for staged, a mode without compiled pieces to upgrade to (``mode``: None
    for auto)."""
    capture = graphs.capture
    if capture not in CAPTURE_WHEN:
        raise ValueError(f"capture: one of {', '.join(CAPTURE_WHEN)}, got {capture!r}")
    if capture in ("auto", "blocking"):
        return capture
    if graphs.verify == "capture":
        raise ValueError(
            f"capture={capture!r}: not with verify='capture', whose replays would overwrite "
            "the outputs of steps running meanwhile; use verify='sample' or 'blocking'"
        )
    if parallel.world_size > 1 or (parallel.micro_batching is not False):
        raise ValueError(
            f"capture={capture!r}: not with tensor or data parallelism or micro-batching "
            "(every rank must capture the same graphs in the same order); use 'blocking'"
        )
    if speculative is not None and speculative.method == "self":
        raise ValueError(
            f"capture={capture!r}: not with speculative='self', whose draft graphs are "
            "captured at start-up; use 'blocking' or 'ngram'"
        )
    if capture == "staged":
        _check_staged(graphs, mode)
    return capture


def auto_capture(
    graphs: GraphArgs,
    parallel: ParallelArgs,
    speculative: SpeculativeConfig | None,
    mode: GraphMode | None,
    graphs_here: bool,
) -> str:
    """What ``capture="auto"`` runs (benchmarks/RESULTS.md, start-up on an H200):
    ``"background"`` where the graphs are FULL graphs of the model's own kernels, which
    compile nothing (FULL or FULL_DECODE_ONLY, on a platform with graphs: ``graphs_here``;
    SmolLM2 answered 3.3-4.2 s after exec against 7.0-9.9 blocking, the 1.5 B shape 4.1-4.5
    against 6.1-13.1; measured on CUDA, the other platforms' graphs compile nothing
    either), and where ``check_capture`` would allow it; ``"blocking"`` elsewhere: modes
    with compiled pieces (Dynamo's trace on the capture thread slowed the steps beside it
    to about 2 tokens a second), several ranks or micro-batching, the capture check, and
    speculative decoding (self-drafting cannot; the others were not measured)."""
    whole = mode in (GraphMode.FULL, GraphMode.FULL_DECODE_ONLY)
    one_rank = parallel.world_size == 1
    allowed = (
        one_rank
        and parallel.micro_batching is False
        and graphs.verify != "capture"
        and speculative is None
    )
    return "background" if whole and allowed and graphs_here else "blocking"


def refuse_ignored(args: EngineArgs, device: torch.device) -> None:
    """Refuses, naming it, an option given (a value other than its default) where nothing
    would read it: ``max_capture_size`` beside ``capture_sizes``, which names every size
    (as ``graphed`` refuses ``max_batch_size`` beside them); ``verify_every`` without
    ``verify='sample'``; ``num_speculative_tokens``
    without a speculation named by its string (``"ngram"``, ``"self:N"``; a
    ``SpeculativeConfig`` carries its own ``k``); ``all_reduce`` on one
    rank; a GPU's index with several ranks, which take their local ranks' GPUs;
    ``gpu_memory_utilization`` on the CPU, whose KV cache is not sized from free memory.
    (``mode='none'`` keeps the ladder's options: it is the switch an A/B flips with every
    other option as it was, and the start-up line says no graph was made.)"""
    graphs, parallel, cache = args.graphs, args.parallel, args.cache
    check_one_ladder("max_capture_size", graphs.max_capture_size, graphs.capture_sizes)
    if _given(graphs, "verify_every") and graphs.verify != "sample":
        raise ValueError(
            f"verify_every={graphs.verify_every!r}: only used with verify='sample', got "
            f"verify={graphs.verify!r}"
        )
    if _given(args, "num_speculative_tokens") and not isinstance(args.speculative, str):
        got = (
            "no speculative decoding"
            if args.speculative is None
            else "a SpeculativeConfig (give its k instead)"
        )
        raise ValueError(
            f"num_speculative_tokens={args.num_speculative_tokens!r}: only used with "
            f"speculative='ngram' or 'self:N', got {got}"
        )
    if _given(parallel, "all_reduce") and parallel.tensor_parallel_size == 1:
        raise ValueError(
            f"all_reduce={parallel.all_reduce!r}: only used with tensor_parallel_size > 1"
        )
    if parallel.world_size > 1 and device.type == "cuda" and device.index is not None:
        raise ValueError(
            f"device={args.device!r}: with {parallel.world_size} ranks each runs on the GPU "
            "of its local rank (cuda:0, cuda:1, ...), so an index would be ignored; give "
            "device='cuda' and choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    if _given(cache, "gpu_memory_utilization") and device.type == "cpu":
        raise ValueError(
            "gpu_memory_utilization: the cpu's KV cache is not sized from free memory; "
            "give num_blocks, or leave it out"
        )


def _given(group: object, name: str) -> bool:
    """Whether the option group's field ``name`` holds a value other than its default."""
    default = next(f.default for f in fields(group) if f.name == name)  # type: ignore[arg-type]
    return getattr(group, name) != default


def _check_staged(graphs: GraphArgs, mode: GraphMode | None) -> None:
    """Staged capture upgrades FULL graphs of the eager model to a mode with compiled
    pieces: it needs one, and a compiler."""
    if mode is not None and not mode.has_piecewise_graphs():
        raise ValueError(
            f"capture='staged': upgrades to compiled pieces, which mode={mode.name.lower()!r} "
            "has none; use mode 'auto', 'piecewise' or 'full_and_piecewise'"
        )
    if graphs.compiler is None:
        raise ValueError("capture='staged': needs a compiler for the pieces; not compiler=None")


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


def check_lora(
    lora: LoraArgs, parallel: ParallelArgs, speculative: SpeculativeConfig | None, capture: str
) -> LoraArgs:
    """``LoraArgs``, checked (``lora_modules`` a tuple of ``"name=path"`` entries, each
    read by ``lora_module``); refuses, naming why, adapters given without
    ``enable_lora`` and LoRA with what does not run it yet: several ranks, speculative
    decoding (its draft and verify steps), and staged capture (its upgrade's graphs)."""
    if not isinstance(lora, LoraArgs):
        raise TypeError(f"lora: expected a LoraArgs, got {type(lora).__name__}")
    given = lora.lora_modules
    modules = (given,) if isinstance(given, str) else tuple(given or ())
    names = [lora_module(entry)[0] for entry in modules]
    if len(set(names)) < len(names):
        raise ValueError(f"lora_modules: a name is given twice in {list(modules)}")
    for name in ("max_loras", "max_lora_rank"):
        value = getattr(lora, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    if not lora.enable_lora:
        # Each would be ignored: refused instead (a value other than its default).
        for f in fields(LoraArgs):
            if f.name != "enable_lora" and getattr(lora, f.name) not in (f.default, ()):
                raise ValueError(f"{f.name}: given without enable_lora=True")
        return lora
    why = None
    if parallel.world_size > 1:
        why = "tensor or data parallelism"
    elif speculative is not None:
        why = "speculative decoding"
    elif capture == "staged":
        why = "capture='staged'"
    if why is not None:
        raise ValueError(f"enable_lora: not with {why} yet; LoRA runs on one GPU")
    return replace(lora, lora_modules=modules)


MAX_CPU_THREADS = 4


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
