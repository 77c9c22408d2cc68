"""``EngineArgs``: the engine's whole configuration, one frozen value that ``LLM`` builds
from its keywords, the command line builds from its flags, and worker processes receive
as it is.

Each option is written once, as a field: its default, its help and, for the command line,
how its text is parsed (``option``). The command line derives its flags from these fields
(``cli_fields``), so a new field is a new flag. Importing this module imports neither
torch nor the engine's modules (``ostinato --help`` answers at once); values are checked
where they are used (``api.arguments``), before anything is loaded.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from ostinato.engine.kernels.options import KernelOptions
from ostinato.ubatch.policy import MicroBatching

if TYPE_CHECKING:
    import torch

    from ostinato.engine.model.attention import AttentionBackend
    from ostinato.engine.spec.speculative import SpeculativeConfig
    from ostinato.modes import GraphMode

Parse = Callable[[str], Any]


def option(default: Any, help: str, parse: Parse | None = None, **cli: Any) -> Any:
    """A field with its help and, for the command line, ``parse`` (text to value: raise
    ``ValueError("name: why")`` on bad text) and argparse's ``choices``; ``cli=False``
    keeps it off the command line (a Python object, or a flag of its own there)."""
    return field(default=default, metadata={"help": help, "parse": parse, **cli})


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def bounded_float(low: float, high: float, low_open: bool) -> Callable[[str], float]:
    """A finite float in ``[low, high]``, or ``(low, high]`` when ``low_open``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        below = value <= low if low_open else value < low
        if not math.isfinite(value) or below or value > high:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"must be in {bracket}{low}, {high}], got {text}")
        return value

    return parse


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    return parse


_fraction = bounded_float(0.0, 1.0, low_open=True)


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(positive_int(t) for t in text.split(","))


def parse_mode(spec: GraphMode | str) -> GraphMode | None:
    """A graph mode, or None for ``"auto"`` (any case); ``ValueError`` lists the names."""
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        return None
    from ostinato.modes import GraphMode

    try:
        return GraphMode.parse(spec)
    except ValueError:
        names = ", ".join(m.lower() for m in GraphMode.__members__)
        raise ValueError(f"mode: unknown graph mode {spec!r}; use auto, {names}") from None


DEVICE_TEXT = re.compile(r"(cpu|cuda)(:\d+)?")


def device_syntax(spec: str) -> str:
    """``spec`` if it is written as a device the engine runs on (``cpu``, ``cuda``,
    ``cuda:N``), checked without importing torch (the command line checks its flags
    before ``serve`` starts the engine's process, which imports torch); ``ValueError``
    otherwise. Whether this machine has that device is ``resolve_device``'s check."""
    if DEVICE_TEXT.fullmatch(spec) is None:
        raise ValueError(
            f"device: {spec!r} is not a device the engine runs on; use cpu, cuda or cuda:N"
        )
    return spec


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """The device to run on (default: CUDA when available, else CPU); ``ValueError``
    names a device the engine does not run on or one this machine lacks."""
    import torch

    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(spec, str):
        device_syntax(spec)
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


def _as_argument_error(check: Callable[[str], Any]) -> Parse:
    """``check`` as a flag's type: its ``ValueError("option: why")`` becomes argparse's
    error for that flag; the text is kept as given."""

    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None
        return text

    return parse


def _parse_speculative(text: str) -> None:
    from ostinato.engine.spec.speculative import SpeculativeConfig

    SpeculativeConfig.parse(text)


def _compiler(text: str) -> str | None:
    return None if text == "none" else text


@dataclass(frozen=True)
class CacheArgs:
    """How much the engine holds at once: sequences per step, tokens per step, the longest
    sequence (default: the model's positions), the KV cache's block size and block count
    (default on CUDA: sized from free memory, using at most ``gpu_memory_utilization`` of
    the device)."""

    block_size: int = option(16, "tokens per KV-cache block", positive_int)
    max_num_seqs: int = option(
        32, "requests that run together at most (the rest wait for a seat)", positive_int
    )
    max_model_len: int | None = option(
        None, "longest prompt + output (default: the model's positions)", positive_int
    )
    max_num_batched_tokens: int | None = option(
        None, "tokens per step at most (default: max(max_model_len, 2048))", positive_int
    )
    num_blocks: int | None = option(
        None, "KV-cache blocks (default: sized from free device memory)", positive_int
    )
    gpu_memory_utilization: float = option(
        0.9, "fraction of the GPU's memory the engine may use", _fraction
    )


LADDER_TOP = 2048
"""The default ladder's largest size at most: where it was measured (a 2048-token step of the
1.5 B shape took 7.5 ms on an H200's device against 9-10 ms of host time eagerly); a larger
step is bound by the device, and its graph costs memory and capture time."""


@dataclass(frozen=True)
class GraphArgs:
    """Which graphs: ``mode`` (a ``GraphMode`` or its name; ``"auto"``: FULL graphs of
    the model's own kernels on CUDA, measured fastest (FULL_AND_PIECEWISE where
    attention cannot be captured whole, and as a staged start's upgrade), NONE on the
    CPU), the capture sizes (default: the ladder up to ``max_capture_size``, by default
    a step's token budget, at most ``LADDER_TOP``: ``startup.capture_limit``; one of
    the two, not both), and
    ``compiler`` for the pieces (``"inductor"``, ``"eager"``, None for no compilation,
    ``"auto"``: Inductor where the mode needs pieces, on CUDA), and when to ``capture``:
    ``"auto"`` (background where the graphs compile nothing and nothing forbids it,
    measured sooner to the first answer; blocking elsewhere: ``arguments.auto_capture``),
    ``"blocking"`` (every graph before the engine returns), ``"background"`` (the engine
    returns once its weights and KV cache are ready; steps run eagerly, or replay what is
    ready, while a thread compiles and captures), or
    ``"staged"`` (FULL graphs of the eager model, which compile nothing, before the
    engine returns; then a thread compiles and captures the mode's graphs and moves each
    bucket to them where it measures faster: ``ostinato.staged``).
    ``verify``: ``"capture"`` checks each FULL graph against eager at capture (padding
    rows given other tokens must leave the real rows bitwise the same), ``"sample"`` one
    replay in ``verify_every`` while serving; a graph that differs is demoted to eager
    (``ostinato.replay_check``)."""

    mode: GraphMode | str = option(
        "auto",
        "graph mode: auto, none, piecewise, full, full_decode_only, full_and_piecewise "
        "(auto: full on CUDA, measured fastest; none on CPU)",
        _as_argument_error(parse_mode),
    )
    capture_sizes: tuple[int, ...] | None = option(
        None, "batch sizes to capture, e.g. 1,2,4,8 (default: the ladder)", _sizes
    )
    max_capture_size: int | None = option(
        None,
        f"the ladder's largest size (default: max_num_batched_tokens, at most {LADDER_TOP}; "
        # (512: config.DEFAULT_MAX_CAPTURE_SIZE, not imported: it would import torch,
        # which ``--help`` does not)
        "FULL_DECODE_ONLY: 512)",
        positive_int,
    )
    compiler: str | None = option(
        "auto",
        "how pieces are compiled: auto, inductor, eager, none",
        _compiler,
        choices=("auto", "inductor", "eager", None),
        metavar="{auto,inductor,eager,none}",
    )
    capture: str = option(
        "auto",
        "capture every graph before the first step (blocking); start at once and "
        "capture while steps run eagerly (background); or capture FULL graphs of the "
        "eager model first and upgrade to the mode's compiled graphs where they "
        "measure faster (staged); auto: background where the graphs compile nothing "
        "(one GPU, no capture check, no speculative decoding), else blocking",
        choices=("auto", "blocking", "background", "staged"),
    )
    verify: str = option(
        "off",
        "check graphs against eager runs: each at capture (capture), or one replay in "
        "--verify-every while serving (sample); a graph that differs runs eagerly after",
        choices=("off", "capture", "sample"),
    )
    verify_every: int = option(1024, "with --verify sample, the replays per check", positive_int)


@dataclass(frozen=True)
class ParallelArgs:
    """Tensor and data parallelism: the sizes, the all-reduce (``"auto"``, ``"nccl"``,
    ``"one-shot"``, ``"two-shot"``), and micro-batch overlap (``True`` for the default
    policy, or a ``MicroBatching``)."""

    tensor_parallel_size: int = option(
        1,
        "GPUs (or CPU processes) that each hold a shard of every layer; the engine starts "
        "the other ranks itself",
        positive_int,
    )
    data_parallel_size: int = option(
        1, "replicas of the model, each stepping its own share of the requests", positive_int
    )
    all_reduce: str = option(
        "auto",
        "tensor parallelism's all-reduce: auto (timed at start-up, and fused with the norm "
        "after it where that times faster), nccl, one-shot, two-shot",
        choices=("auto", "nccl", "one-shot", "two-shot"),
    )
    micro_batching: MicroBatching | bool = option(
        False, "split large steps into two overlapped micro-batches (tensor parallelism)"
    )

    @property
    def world_size(self) -> int:
        """The ranks the engine runs: ``tensor_parallel_size * data_parallel_size``."""
        return self.tensor_parallel_size * self.data_parallel_size


def lora_module(entry: str) -> tuple[str, str]:
    """One ``lora_modules`` entry, ``"name=path"``, as ``(name, path)``; ``ValueError``
    names an entry of another form."""
    name, sep, path = str(entry).partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"lora_modules: {entry!r} is not name=path")
    return name.strip(), path.strip()


@dataclass(frozen=True)
class LoraArgs:
    """LoRA adapters: ``enable_lora`` makes room on the device for ``max_loras`` adapters
    of rank up to ``max_lora_rank`` (their slots; requests of more adapters wait for
    one); ``lora_modules`` (``"name=path"`` each, PEFT folders) are loaded at start-up,
    and more with ``LLM.load_lora``. ``specialize_lora``: steps without a LoRA row
    replay graphs without the LoRA GEMMs (twice the graphs)."""

    enable_lora: bool = option(False, "serve LoRA adapters (slots on the device)")
    max_loras: int = option(4, "adapters held on the device at once", positive_int)
    max_lora_rank: int = option(16, "the largest adapter rank", positive_int)
    lora_modules: tuple[str, ...] = option(
        (),
        "adapters to load at start-up: name=path (PEFT folders)",
        _as_argument_error(lora_module),
        nargs="+",
    )
    specialize_lora: bool = option(
        True, "capture graphs without the LoRA GEMMs for steps with no LoRA row"
    )


# The groups by the ``EngineArgs`` field that holds each.
GROUPS: dict[str, type] = {
    "cache": CacheArgs,
    "graphs": GraphArgs,
    "parallel": ParallelArgs,
    "kernels": KernelOptions,
    "lora": LoraArgs,
}


@dataclass(frozen=True)
class EngineArgs:
    """Everything an engine is built from. The groups (``cache``, ``graphs``,
    ``parallel``, ``kernels``, ``lora``) hold most options; the rest are here. ``build`` makes one
    from ``LLM``'s keywords; a worker process receives the same value."""

    model: Any = option(None, "the model (see LLM)", cli=False)
    cache: CacheArgs = field(default_factory=CacheArgs)
    graphs: GraphArgs = field(default_factory=GraphArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    kernels: KernelOptions = field(default_factory=KernelOptions)
    lora: LoraArgs = field(default_factory=LoraArgs)
    device: str | None = option(
        None,
        "cpu, cuda or cuda:N (default: cuda when available)",
        _as_argument_error(device_syntax),
    )
    dtype: Any = option(
        None,
        "the weights' dtype (default: float32 on CPU; on CUDA the checkpoint's, or bfloat16)",
        choices=("float32", "bfloat16", "float16"),
    )
    random_weights: bool = option(
        False, "use the model's config with random weights (for shape tests)"
    )
    speculative: SpeculativeConfig | str | None = option(
        None,
        "speculative decoding: ngram (prompt lookup) or self:N (the first N layers draft); "
        "default: none",
        _as_argument_error(_parse_speculative),
    )  # fmt: skip
    num_speculative_tokens: int = option(
        2, "draft tokens verified per step (with speculative)", bounded_int(1, 16)
    )
    async_scheduling: bool = option(
        True, "schedule and stage step N+1 while step N runs (same outputs)"
    )
    seed: int = option(0, "seed of random weights and sampling", int)
    cache_dir: Any = option(None, "where converted and compiled artifacts are kept", cli=False)
    backend: AttentionBackend | None = option(None, "an attention backend", cli=False)
    progress: bool = option(True, "show a progress bar while capturing", cli=False)

    @classmethod
    def build(cls, model: Any = None, **keywords: Any) -> EngineArgs:
        """The configuration ``LLM(model, **keywords)`` asks for: top-level fields and
        groups by name, and every group field as a plain keyword (``mode=``,
        ``max_model_len=``, ``pdl=``, ...). ``TypeError`` names a keyword nothing has, a
        group of the wrong type, and a field given both plainly and in its group."""
        top = {f.name for f in fields(cls)}
        owner = {f.name: attr for attr, g in GROUPS.items() for f in fields(g)}
        given: dict[str, Any] = {k: v for k, v in keywords.items() if k in top}
        plain: dict[str, dict[str, Any]] = {attr: {} for attr in GROUPS}
        for name, value in keywords.items():
            if name in top:
                continue
            if name not in owner:
                known = ", ".join(sorted(top - {"model"} | set(owner)))
                raise TypeError(f"LLM: unexpected keyword argument {name!r}; known: {known}")
            plain[owner[name]][name] = value
        for attr, updates in plain.items():
            group = GROUPS[attr]
            held = given.get(attr)
            if held is None:
                held = group()
            elif not isinstance(held, group):
                raise TypeError(f"{attr}: expected a {group.__name__}, got {type(held).__name__}")
            elif updates:
                name = next(iter(updates))
                raise TypeError(
                    f"{name}: given as a keyword and in a {group.__name__} too; give it once"
                )
            given[attr] = replace(held, **updates)
        return cls(model=model, **{k: v for k, v in given.items() if k != "model"})


def cli_fields() -> list[Field[Any]]:
    """The fields the command line takes: those of the groups and the top-level ones,
    but for those marked ``cli=False`` (``EngineArgs.build`` puts each in its place)."""
    out: list[Field[Any]] = []
    for f in fields(EngineArgs):
        candidates = fields(GROUPS[f.name]) if f.name in GROUPS else (f,)
        out += [g for g in candidates if g.metadata.get("cli", True)]
    return out


def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """One flag per ``cli_fields`` field (``--max-num-seqs``; booleans, and fields whose
    metadata says ``switch`` (a bool or None: left unset), as ``--name/--no-name``), its
    help, type and default from the field."""
    for f in cli_fields():
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is MISSING else f.default
        meta = f.metadata
        if isinstance(default, bool) or meta.get("switch"):
            action = argparse.BooleanOptionalAction
            parser.add_argument(flag, action=action, default=default, help=meta.get("help"))
            continue
        kwargs: dict[str, Any] = {"default": default, "help": meta.get("help")}
        if meta.get("parse") is not None:
            kwargs["type"] = meta["parse"]
        for key in ("choices", "metavar", "nargs"):
            if meta.get(key) is not None:
                kwargs[key] = meta[key]
        parser.add_argument(flag, **kwargs)


def from_cli(namespace: argparse.Namespace, **extra: Any) -> EngineArgs:
    """The ``EngineArgs`` of parsed flags (``add_cli_options``), with ``extra`` fields."""
    values = {f.name: getattr(namespace, f.name) for f in cli_fields()}
    return EngineArgs.build(**values, **extra)
