"""GraphConfig: which graphs to capture, for which batch sizes, and how."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ostinato.mathutil import checked_bool, is_int, repeated
from ostinato.modes import GraphMode
from ostinato.replay_check import DEFAULT_EVERY, ReplayCheck

DEFAULT_MAX_CAPTURE_SIZE = 512
# More sizes than this is a mistake, not a ladder: each is a graph to capture and hold.
MAX_CAPTURE_SIZES = 1024


# The ladder: these small sizes, then every ``_STEP`` from ``_FIRST_ABOVE`` up to
# ``_COARSE_FROM``, then every ``_COARSE_STEP``. Why coarse above: a step that large is
# bound by its work, so padding up to 127 tokens (at most a fifth) costs less than the
# graphs a finer ladder holds; on an H200 an engine whose ladder went on to its 2048-token
# budget this way served 64 streams 23% faster than one that ran those steps eagerly, for
# 12 graphs more (0.08 s of capture, 112 MiB of pool).
_SMALL = (1, 2, 4, *range(8, 257, 8))
_FIRST_ABOVE, _STEP = 272, 16
_COARSE_FROM, _COARSE_STEP = 512, 128


def _ladder_top(limit: int) -> tuple[int, int]:
    """How many sizes of the ladder's three runs are at most ``limit``, and the last."""
    below = [s for s in _SMALL if s <= limit]
    count, last = len(below), below[-1]
    if limit >= _FIRST_ABOVE:
        fine = (min(limit, _COARSE_FROM) - _FIRST_ABOVE) // _STEP + 1
        count, last = count + fine, _FIRST_ABOVE + _STEP * (fine - 1)
    if limit >= _COARSE_FROM + _COARSE_STEP:
        coarse = (limit - _COARSE_FROM) // _COARSE_STEP
        count, last = count + coarse, _COARSE_FROM + _COARSE_STEP * coarse
    return count, last


def ladder_length(max_capture_size: int, exact_up_to: int = 0) -> int:
    """How many sizes ``exact_capture_sizes(max_capture_size, exact_up_to)`` has (``>= 1``;
    ``default_capture_sizes``' with ``exact_up_to`` 0), without building the ladder."""
    if exact_up_to >= max_capture_size:
        return max_capture_size
    count, last = _ladder_top(max_capture_size)
    replaced = _ladder_top(exact_up_to)[0] if exact_up_to >= 1 else 0  # (the ladder's below)
    return count + (last != max_capture_size) + exact_up_to - replaced


def check_ladder_length(limit: int, name: str = "max_capture_size", exact_up_to: int = 0) -> None:
    """``ValueError`` naming ``name`` (the argument as the caller wrote it) where the
    ladder up to ``limit`` has more than ``MAX_CAPTURE_SIZES`` sizes."""
    sizes = ladder_length(limit, exact_up_to)
    if sizes > MAX_CAPTURE_SIZES:
        raise ValueError(
            f"{name}: {limit} makes a ladder of {sizes} sizes, more than "
            f"{MAX_CAPTURE_SIZES} graphs to capture and hold; lower it (larger batches run "
            "eagerly) or give capture_sizes"
        )


def check_one_ladder(top_name: str, top: object, capture_sizes: object) -> None:
    """``ValueError`` where both a ladder's top (``top_name``) and ``capture_sizes`` are
    given (neither None): named sizes have no ladder, so the top would be ignored."""
    if top is not None and capture_sizes is not None:
        raise ValueError(
            f"{top_name}={top!r} and capture_sizes={capture_sizes!r}: give one (a ladder up "
            f"to {top_name}, or exactly capture_sizes), not both"
        )


def default_capture_sizes(max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE) -> list[int]:
    """The default ladder: 1, 2, 4, multiples of 8 up to 256, of 16 up to 512, of 128
    above.

    Guarantees: sorted ascending, no duplicates, every size ``<= max_capture_size``,
    and ``max_capture_size`` itself is included when it is not already on the ladder,
    so that every batch up to it has a graph.
    """
    if max_capture_size < 1:
        raise ValueError(
            f"max_capture_size: must be >= 1, got {max_capture_size}; "
            "use GraphMode.NONE to run without graphs"
        )
    fine = range(_FIRST_ABOVE, _COARSE_FROM + 1, _STEP)
    coarse = range(_COARSE_FROM + _COARSE_STEP, max_capture_size + 1, _COARSE_STEP)
    sizes = [s for s in (*_SMALL, *fine, *coarse) if s <= max_capture_size]
    if sizes[-1] != max_capture_size:
        sizes.append(max_capture_size)
    return sizes


def exact_capture_sizes(max_capture_size: int, exact_up_to: int) -> list[int]:
    """Every size from 1 to ``exact_up_to`` (no padding there), then the default ladder's
    sizes above it, up to ``max_capture_size``; ``default_capture_sizes``' guarantees."""
    above = [s for s in default_capture_sizes(max_capture_size) if s > exact_up_to]
    return [*range(1, min(exact_up_to, max_capture_size) + 1), *above]


@dataclass(frozen=True)
class GraphConfig:
    """What to capture. Validated on construction: a field of the wrong type raises
    ``TypeError``, a bad value ``ValueError`` (so does a ladder of more than
    ``MAX_CAPTURE_SIZES`` sizes), each naming the field.

    ``mode``: a ``GraphMode``, its name, or ``"auto"`` (stored as None): the strongest mode
    the platform and the caller allow, chosen by ``build_graph_runtime``.
    ``capture_sizes``: the token counts to capture (default: the ladder of
    ``default_capture_sizes`` up to ``max_capture_size``, None: ``DEFAULT_MAX_CAPTURE_SIZE``),
    stored sorted ascending; one of the two, not both (named sizes have no ladder).
    ``max_num_tokens``: the runner's token budget per step, when known; no capture size may
    exceed it. ``specialize_lora``: capture separate graphs for batches with and without
    LoRA. ``num_warmups``: eager runs before each capture.

    Checks, off by default because they cost time:
    ``verify``: ``"capture"`` replays each FULL graph once after capture and compares it
    bitwise with an eager run of the same step, and (where the caller can perturb padding
    rows) that padding never reaches real rows (start-up cost); ``"sample"`` re-runs one
    FULL replay in ``verify_every`` eagerly while serving and compares within the dtype's
    tolerance. A bucket that differs is demoted to eager with a warning naming it
    (``ostinato.replay_check``). ``verify_graphs=True`` is ``verify="capture"``.
    ``check_addresses``: on every replay, check that
    each tensor argument still sits at its captured address (per-step cost; names the
    input that moved); it applies to graphs whose inputs are arguments, the pieces of a
    ``PiecewiseBackend`` made with this flag (as the engine does), not to a FULL step,
    which reads its inputs from the caller's persistent buffers.
    """

    mode: GraphMode | None = GraphMode.FULL
    capture_sizes: tuple[int, ...] | None = None
    max_capture_size: int | None = None
    max_num_tokens: int | None = None
    specialize_lora: bool = False
    num_warmups: int = 1
    verify_graphs: bool = False
    check_addresses: bool = False
    verify: str = "off"
    verify_every: int = DEFAULT_EVERY
    # Filled in by __post_init__; not an argument.
    sizes: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.mode, str) and self.mode.strip().lower() == "auto":
            object.__setattr__(self, "mode", None)
        elif self.mode is not None:
            object.__setattr__(self, "mode", GraphMode.parse(self.mode))
        if self.max_num_tokens is not None and self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens: must be >= 1, got {self.max_num_tokens}")
        if self.verify_graphs and self.verify not in ("off", "capture"):
            raise ValueError(
                f"verify_graphs=True is verify='capture'; not with verify={self.verify!r} "
                "(give one of them)"
            )
        if self.verify_graphs:
            object.__setattr__(self, "verify", "capture")
        self.replay_check  # noqa: B018 - validates verify and verify_every
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups: must be >= 0, got {self.num_warmups}")
        check_one_ladder("max_capture_size", self.max_capture_size, self.capture_sizes)
        if self.capture_sizes is None:
            limit = self.max_capture_size
            if limit is None:
                limit = DEFAULT_MAX_CAPTURE_SIZE
            if self.max_num_tokens is not None:
                limit = min(limit, self.max_num_tokens)
            if limit >= 1:
                check_ladder_length(limit)
            sizes = default_capture_sizes(limit)
        else:
            sizes = _validated_sizes(self.capture_sizes, self.max_num_tokens)
            object.__setattr__(self, "capture_sizes", tuple(self.capture_sizes))
        object.__setattr__(self, "sizes", tuple(sizes))

    def _check_types(self) -> None:
        """``TypeError`` naming a field of the wrong type (a string where a number goes
        would otherwise fail later, in a comparison, naming nothing)."""
        if not is_int(self.num_warmups):
            raise TypeError(f"num_warmups: expected an int, got {self.num_warmups!r}")
        if self.max_capture_size is not None and not is_int(self.max_capture_size):
            raise TypeError(
                f"max_capture_size: expected an int or None, got {self.max_capture_size!r}"
            )
        if self.max_num_tokens is not None and not is_int(self.max_num_tokens):
            raise TypeError(f"max_num_tokens: expected an int or None, got {self.max_num_tokens!r}")
        for name in ("specialize_lora", "verify_graphs", "check_addresses"):
            checked_bool(name, getattr(self, name))

    @property
    def replay_check(self) -> ReplayCheck:
        """What ``verify`` and ``verify_every`` ask of the graph manager."""
        return ReplayCheck(self.verify, self.verify_every)  # type: ignore[arg-type]

    @property
    def largest_size(self) -> int:
        """The largest captured token count; larger batches run eagerly."""
        return self.sizes[-1]


def _validated_sizes(sizes: Sequence[int], max_num_tokens: int | None) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise ValueError(f"capture_sizes: expected a sequence of ints, got {type(sizes).__name__}")
    if not sizes:
        raise ValueError(
            "capture_sizes: empty; leave it as None for the default ladder, "
            "or use mode 'none' (GraphMode.NONE) to capture nothing"
        )
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"capture_sizes: {s!r} is not an int")
        if s < 1:
            raise ValueError(f"capture_sizes: {s} is not positive; every size must be >= 1")
    dupes = repeated(sizes)
    if dupes:
        raise ValueError(f"capture_sizes: duplicate sizes {dupes}; list each size once")
    if len(sizes) > MAX_CAPTURE_SIZES:
        raise ValueError(
            f"capture_sizes: {len(sizes)} sizes, more than {MAX_CAPTURE_SIZES} graphs to capture "
            "and hold; keep a ladder (padding to the next size costs little)"
        )
    if max_num_tokens is not None:
        too_big = sorted(s for s in sizes if s > max_num_tokens)
        if too_big:
            raise ValueError(
                f"capture_sizes: {too_big} exceed max_num_tokens={max_num_tokens}; "
                "drop them or raise the token budget"
            )
    return sorted(sizes)
