"""``graphed(fn)``: any PyTorch callable as graphs for every batch size, in one call.

    fast = ostinato.graphed(model, max_batch_size=64)
    out = fast(x)                    # same arguments, same outputs, any batch 1..64

Per call the wrapper pads the batch (dim 0 of every tensor argument) up to its bucket,
copies the arguments into persistent buffers, replays the bucket's graph and returns the
outputs cut to the real batch; a batch above the largest bucket runs eagerly on the
caller's tensors. Tensor arguments may sit anywhere in ``args`` and ``kwargs`` (tuples,
lists, dicts); outputs may be any tree of tensors. Arguments that are not tensors
(``None``, numbers, strings, dtypes, devices) are part of the graph's key: each distinct
set, like each distinct shape past the dynamic dims, is a signature with graphs of its
own, up to ``max_signatures``; anything else is refused by name. ``seq_buckets`` makes
a second dimension dynamic (``seq_dim``, 1 by default, of every tensor argument that has
it, padded with zeros to the smallest bucket that holds it; outputs with a bucket's
length there are cut back).

By default (``capture="auto"``) a signature's first graphs hold ``fn``'s own kernels,
captured at its first call; a thread compiles ``fn`` with Inductor meanwhile, and later
calls capture and time its graphs, one bucket per call on the caller's thread, moving each
bucket where they are faster (``wait_for_upgrades`` does the rest at once).

Guarantees: outputs equal ``fn``'s on the same arguments (the graph computes the padded
batch; padding rows start as zeros). By default they are lent, as reduce-overhead's are:
the graph's own outputs, in the pool every ``graphed`` callable of the platform shares,
valid until the next call of any of them (from any thread: threads sharing callables want
``copy_outputs``), after which any access to them (or to views of them) raises, never
reads another call's values; where the platform cannot revoke an alias (the
CPU), and where they come from pieces (PIECEWISE), they are copies. With ``copy_outputs``
every output is a copy that belongs to the caller (a copy per call: GPT-2's logits cost
0.1-0.2 ms and their size again in memory at 32 rows). With ``check_padding`` (the
default) the first call of a signature that graphs runs ``fn`` twice eagerly with
different padding contents and raises ``PaddingChangesRealRowsError`` if real rows
differ (a batch norm in training mode, a reduction over the batch). On a platform
without graphs (the CPU) every call runs ``fn`` eagerly with the same API, and the first
call warns once with the reason. ``stats()`` counts replays, padding and eager calls per
bucket.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import (
    TreeSpec,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)

from ostinato.batch import BatchDescriptor
from ostinato.compile_artifacts import ArtifactStore, identity
from ostinato.config import GraphConfig, check_ladder_length, check_one_ladder, exact_capture_sizes
from ostinato.dispatcher import Dispatch
from ostinato.errors import GraphCaptureError, OstinatoError
from ostinato.graph_outputs import OutputLender, PoolOutputs, lent_anywhere, shared_lender
from ostinato.mathutil import checked_bool, checked_int, is_int, repeated
from ostinato.modes import GraphMode
from ostinato.platform import Platform, current_platform
from ostinato.platform.cpu import CpuPlatform
from ostinato.replay_stats import StatsSnapshot
from ostinato.runtime import GraphRuntime, build_graph_runtime, choose_compiler
from ostinato.staged import StagedRuntime
from ostinato.whole_compile import AsModule, CallTree, SharedCompiles, WholeCompiled

CAPTURE_WHEN = ("auto", "first_use", "construction", "background", "staged")
# Held by every capture graphed makes and by a staged upgrade's thread while it runs its
# compiled function (Inductor's autotuning synchronizes the device): a capture cannot
# overlap a device-wide synchronize, nor another thread's use of the default generator.
_DEVICE = threading.RLock()
# A graph for every batch size up to here, the default ladder above: a size between two
# buckets paid for its padding (H200, bf16: up to 1.31x reduce-overhead's step, which
# records every size it meets), where a graph per size kept six models' streams within 5%
# of it at every size but 2 of 28 in one run; the price is more graphs to capture (32 a
# signature, not 7) and a longer upgrade in the background (benchmarks/RESULTS.md).
EXACT_UP_TO = 32
KEY_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)
MAX_SIGNATURES = 8


class PaddingChangesRealRowsError(OstinatoError, ValueError):
    """``fn``'s real rows depend on the padding rows: graphs would change its answers."""


class SignatureLimitError(OstinatoError, ValueError):
    """More distinct argument signatures than ``max_signatures``."""


@dataclass(frozen=True)
class SignatureStats:
    """One signature (``key``: shapes past the dynamic dims, dtypes, constants) and its
    buckets' statistics; with ``capture="staged"``, ``upgrade``: how far its upgrade is,
    or why it stopped (``StagedRuntime.summary``), and ``upgraded``: the statistics of
    the upgrade's graphs (the calls of buckets that moved; None before it is built)."""

    key: str
    stats: StatsSnapshot
    upgrade: str = ""
    upgraded: StatsSnapshot | None = None

    @property
    def replays(self) -> int:
        """Calls that ran from graphs, on either stage."""
        return self.stats.replays + (self.upgraded.replays if self.upgraded else 0)


@dataclass(frozen=True)
class GraphedStats:
    """Every signature's buckets, and the calls that ran eagerly because a dynamic
    sequence was longer than the largest of ``seq_buckets`` (``eager_too_long``) or
    because their signature's first capture waited for the device: another signature's
    upgrade running its compiler, or a capture on another thread (``eager_device_busy``;
    captured at a later call); and how many compiled functions were loaded from the
    cache folder (``compiled_loaded``) or kept there for the next process
    (``compiled_kept``)."""

    signatures: tuple[SignatureStats, ...]
    eager_too_long: int
    eager_device_busy: int = 0
    compiled_loaded: int = 0
    compiled_kept: int = 0

    @property
    def replays(self) -> int:
        return sum(s.replays for s in self.signatures)

    @property
    def eager(self) -> int:
        eager = sum(s.stats.eager for s in self.signatures)
        return eager + self.eager_too_long + self.eager_device_busy

    def summary(self) -> str:
        lines = [f"{len(self.signatures)} signature(s), {self.replays} calls from graphs"]
        for s in self.signatures:
            lines.append(f"  {s.key}: {s.stats.summary()}")
            lines += [f"    {s.upgrade}"] if s.upgrade else []
            lines += [f"    upgraded: {s.upgraded.summary()}"] if s.upgraded else []
        if self.eager_too_long:
            lines.append(f"  {self.eager_too_long} eager: longer than the largest seq bucket")
        if self.eager_device_busy:
            lines.append(
                f"  {self.eager_device_busy} eager: the capture waited for the device (an "
                "upgrade's compile or another capture)"
            )
        if self.compiled_loaded or self.compiled_kept:
            lines.append(
                f"  compiled functions: {self.compiled_loaded} loaded from the cache folder, "
                f"{self.compiled_kept} kept there for the next process"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class _Call:
    """One call's arguments, flattened: the leaves, the tree, the tensor leaves' slots,
    the batch size, the dynamic sequence's length and its bucket (0: none)."""

    leaves: list[Any]
    spec: TreeSpec
    slots: tuple[int, ...]
    batch: int
    length: int
    bucket: int


def graphed(
    fn: Callable[..., Any],
    *,
    max_batch_size: int | None = None,
    capture_sizes: Sequence[int] | None = None,
    mode: str | GraphMode = "auto",
    seq_buckets: Sequence[int] | None = None,
    seq_dim: int | None = None,
    splitting_ops: Sequence[str] = (),
    full_when: Callable[..., bool] | None = None,
    compiler: str | None = "auto",
    capture: str = "auto",
    example: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
    copy_outputs: bool = False,
    check_padding: bool = True,
    max_signatures: int = MAX_SIGNATURES,
    platform: Platform | None = None,
    progress: bool = False,
    cache_dir: str | os.PathLike[str] | bool | None = None,
) -> Graphed:
    """``fn`` (a module or function) as graphs; see the module docstring. ``mode``:
    ``"auto"`` (FULL, or PIECEWISE with ``splitting_ops``), ``"full"``, ``"piecewise"``,
    ``"none"`` (no graph: the A/B switch, every other option kept), and two that need
    ``full_when``: ``"full_and_piecewise"`` (a call ``full_when(*args, **kwargs)`` accepts
    replays one FULL graph, others the pieces) and ``"full_decode_only"`` (others eager).
    ``splitting_ops``: custom ops (``"lib::op"``) that run eagerly between captured
    pieces (PIECEWISE, FULL_AND_PIECEWISE), compiled by ``compiler``. Without them,
    ``compiler="inductor"`` compiles ``fn`` whole before its FULL graphs are captured
    (fused kernels for a compilation's start-up); ``"auto"`` captures ``fn`` as it is.
    ``capture``: ``"auto"`` (``"staged"`` for FULL graphs without ``splitting_ops`` and
    with ``compiler="auto"``, else ``"first_use"``), ``"first_use"`` (each signature on
    its first call), ``"construction"`` (now, for ``example = (args, kwargs)``),
    ``"background"`` (each call captures one graph at most, on the caller's thread: its
    bucket's if missing, else the next; eager while the device is busy) or ``"staged"``
    (graphs of ``fn`` as it is at once, then Inductor's per bucket where timed faster).
    ``max_batch_size`` (default 64) makes the ladder up to it (a graph for every size to
    ``EXACT_UP_TO``, then multiples of 8), ``capture_sizes`` names the sizes instead: give
    one or neither. ``cache_dir``: where Inductor's compilations of ``fn`` are kept for
    the next process (``compile_artifacts``; None: the user cache folder, False: nowhere).
    Every argument is checked here; an error names the argument as written."""
    splitting, resolved, capture = _modes(splitting_ops, mode, full_when, capture, compiler)
    return Graphed(
        fn,
        _Options(
            GraphConfig(mode=resolved, **_ladder(max_batch_size, capture_sizes)),
            _check_buckets(seq_buckets),
            _check_dim(seq_dim, seq_buckets),
            splitting,
            full_when,
            _check_compiler(compiler),
            capture,
            checked_bool("copy_outputs", copy_outputs),
            checked_bool("check_padding", check_padding),
            checked_int("max_signatures", max_signatures),
            _check_platform(platform),
            checked_bool("progress", progress),
            _artifact_store(cache_dir, fn, splitting, capture, compiler),
        ),
        example,
    )


def _ladder(max_batch_size: object, capture_sizes: object) -> dict[str, Any]:
    """``GraphConfig``'s ladder fields from ``graphed``'s two ways of giving it."""
    if capture_sizes is None:
        size = 64 if max_batch_size is None else checked_int("max_batch_size", max_batch_size)
        check_ladder_length(size, "max_batch_size", EXACT_UP_TO)  # (GraphConfig's, by name)
        return {"capture_sizes": tuple(exact_capture_sizes(size, EXACT_UP_TO))}
    check_one_ladder("max_batch_size", max_batch_size, capture_sizes)
    if isinstance(capture_sizes, (str, bytes)) or not isinstance(capture_sizes, Sequence):
        raise TypeError(
            f"capture_sizes: expected a sequence of positive ints, got {capture_sizes!r}"
        )
    return {"capture_sizes": tuple(capture_sizes)}


def _check_ops(ops: object) -> tuple[str, ...]:
    if (
        isinstance(ops, str)
        or not isinstance(ops, Sequence)
        or not all(isinstance(op, str) and "::" in op for op in ops)
    ):
        raise TypeError(f"splitting_ops: expected a sequence of 'lib::op' names, got {ops!r}")
    return tuple(ops)


def _check_platform(platform: object) -> Platform | None:
    if platform is not None and not isinstance(platform, Platform):
        raise TypeError(f"platform: expected an ostinato Platform or None, got {platform!r}")
    return platform


def _check_dim(dim: object, buckets: object) -> int:
    """``seq_dim`` as given (1 by default), refused without ``seq_buckets`` (it would be
    ignored) and below 1 (dim 0 is the batch)."""
    if dim is None:
        return 1
    if not is_int(dim):
        raise TypeError(f"seq_dim: expected an int (a dimension), got {dim!r}")
    if buckets is None:
        raise ValueError(
            f"seq_dim={dim!r}: only used with seq_buckets (it says where their sequence "
            "is); pass seq_buckets too, or leave seq_dim out"
        )
    if dim < 1:  # type: ignore[operator]
        raise ValueError(
            f"seq_dim: the sequence's dimension, 1 or more (dim 0 is the batch), got {dim!r}"
        )
    return int(dim)  # type: ignore[call-overload]


@dataclass(frozen=True)
class _Options:
    config: GraphConfig
    seq_buckets: tuple[int, ...]
    seq_dim: int
    splitting_ops: tuple[str, ...]
    full_when: Callable[..., bool] | None
    compiler: str | None
    capture: str
    copy_outputs: bool
    check_padding: bool
    max_signatures: int
    platform: Platform | None
    progress: bool
    store: ArtifactStore | None


class Graphed:
    """The callable ``graphed`` returns (see the module docstring)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        options: _Options,
        example: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"graphed: expected a module or function, got {type(fn).__name__}")
        self.fn, self.options = fn, options
        self._signatures: dict[tuple[Any, ...], _Signature] = {}
        self._compiles = SharedCompiles(options.store)
        self._lock = threading.Lock()  # (two threads' first calls build one signature)
        self._eager_too_long = 0
        self._eager_device_busy = 0
        self._warned = False
        if options.capture == "construction":
            if example is None:
                raise ValueError(
                    "example: capture='construction' needs example=(args, kwargs), a call "
                    "whose signature to capture now"
                )
            self._signature(self._flatten(*example))
        elif example is not None:
            raise ValueError("example: only used with capture='construction'")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self._flatten(args, kwargs)
        for i in call.slots:  # (a lent output's memory may be written next: read it now)
            if lent_anywhere(call.leaves[i]):
                call.leaves[i] = call.leaves[i].clone()
        if call.length and not call.bucket:  # longer than every seq bucket
            self._eager_too_long += 1
            return self.fn(*args, **kwargs)
        signature = self._signature(call)
        if not signature.try_ready():  # the device is busy (a compile, a capture): eager
            self._eager_device_busy += 1
            return self.fn(*args, **kwargs)
        return signature.run(call, self._full(args, kwargs))

    def _full(self, args: Any, kwargs: Any) -> bool:
        """Whether this call may replay a FULL graph in a mode that treats calls
        differently (``full_when``'s answer; False without it)."""
        if self.options.full_when is None:
            return False
        answer = self.options.full_when(*args, **kwargs)
        if not isinstance(answer, bool):
            raise TypeError(f"full_when: must return a bool, returned {type(answer).__name__}")
        return answer

    def stats(self) -> GraphedStats:
        """Live statistics of every signature's buckets (safe from any thread)."""
        signatures = tuple(s.stats(k) for k, s in self._items())
        loaded, kept = self._compiles.artifacts()
        return GraphedStats(signatures, self._eager_too_long, self._eager_device_busy, loaded, kept)

    def wait_for_upgrades(self, timeout: float | None = None) -> bool:
        """With ``capture="staged"``: captures every signature still waiting for the
        device (``eager_device_busy``), then waits until every signature's upgrade has
        ended (each bucket decided, or the upgrade stopped: ``stats`` says which), its
        compile at most ``timeout`` seconds each; returns whether all have. True without
        staged capture."""
        signatures = [s for _, s in self._items()]
        for s in signatures:
            s.try_ready(wait=True)
        return all(s.staged.wait(timeout) for s in signatures if s.staged is not None)

    def release(self) -> None:
        """Destroys every graph; the next call of a signature captures it anew."""
        with self._lock:
            signatures, self._signatures = list(self._signatures.values()), {}
        for s in signatures:
            s.release()
        self._compiles.clear()

    def _items(self) -> list[tuple[str, _Signature]]:
        with self._lock:
            return [(s.describe(), s) for s in self._signatures.values()]

    def _flatten(self, args: Any, kwargs: Any) -> _Call:
        return flatten_call(args, kwargs, self.options.seq_buckets, self.options.seq_dim)

    def _signature(self, call: _Call) -> _Signature:
        key = signature_key(call, self.options.seq_dim)
        found = self._signatures.get(key)
        if found is not None:
            return found
        with self._lock:
            if key not in self._signatures:
                if len(self._signatures) >= self.options.max_signatures:
                    raise SignatureLimitError(_too_many(key, self.options.max_signatures))
                made = _Signature(self.fn, call, self.options, key, self._compiles)
                self._signatures[key] = made
                self._say_why_eager(made)
                self._keep_resolution(made)
            return self._signatures[key]

    def _keep_resolution(self, made: _Signature) -> None:
        # Later signatures ask for the mode the first one resolved to, so that a
        # downgrade (the CPU has no graphs) is logged once, not once per signature.
        if self.options.config.mode is not made.runtime.mode:
            config = dataclasses.replace(self.options.config, mode=made.runtime.mode)
            self.options = dataclasses.replace(self.options, config=config)

    def _say_why_eager(self, signature: _Signature) -> None:
        if signature.runtime.mode is GraphMode.NONE and not self._warned:
            self._warned = True
            why = "; ".join(signature.runtime.resolution.reasons)
            if not signature.platform.supports_graphs:
                why = f"the {signature.platform.name} platform has no graphs"
            warnings.warn(
                f"ostinato.graphed: every call runs eagerly: {why or 'mode NONE was asked for'}",
                stacklevel=4,
            )


def flatten_call(args: Any, kwargs: Any, seq_buckets: tuple[int, ...], seq_dim: int) -> _Call:
    """One call's arguments as leaves; ``TypeError`` / ``ValueError`` naming the
    argument that is neither a batched tensor nor a constant."""
    with_paths, spec = tree_flatten_with_path((tuple(args), dict(kwargs)))
    leaves = [leaf for _, leaf in with_paths]
    slots, batch, length = [], None, None
    for i, (path, leaf) in enumerate(with_paths):
        name = _name(path)
        if isinstance(leaf, torch.Tensor):
            batch = _same("batch (dim 0)", name, leaf, 0, batch)
            if seq_buckets and leaf.dim() > seq_dim:
                length = _same(f"sequence (dim {seq_dim})", name, leaf, seq_dim, length)
            slots.append(i)
        elif not isinstance(leaf, KEY_TYPES):
            raise TypeError(
                f"{name}: a {type(leaf).__name__} is neither a tensor nor a constant "
                "(None, bool, int, float, str, dtype, device); pass it as tensors, or "
                "close over it in the function you graph"
            )
    if batch is None:
        raise ValueError("graphed: the call has no tensor argument to take the batch from")
    bucket = next((b for b in seq_buckets if b >= length), 0) if length else 0
    return _Call(leaves, spec, tuple(slots), batch, length or 0, bucket)


def signature_key(call: _Call, seq_dim: int) -> tuple[Any, ...]:
    """What must match for two calls to share graphs: the tree, the constants, and each
    tensor's dtype, device and shape past the batch (the sequence at its bucket)."""
    tensors, constants = [], []
    for i, leaf in enumerate(call.leaves):
        if i in call.slots:
            shape = list(leaf.shape[1:])
            if call.bucket and leaf.dim() > seq_dim:
                shape[seq_dim - 1] = call.bucket
            tensors.append((tuple(shape), leaf.dtype, leaf.device))
        else:
            constants.append((i, type(leaf), leaf))
    return (call.spec, tuple(constants), tuple(tensors))


class _Signature:
    """The graphs of one signature: persistent buffers, one per tensor argument,
    ``[largest bucket, *shape]``, and the runtime whose step reads them."""

    def __init__(
        self,
        fn: Callable[..., Any],
        first: _Call,
        options: _Options,
        key: tuple[Any, ...],
        compiles: SharedCompiles,
    ) -> None:
        self.fn, self.options, self.key, self.compiles = fn, options, key, compiles
        self.slots, self.bucket = first.slots, first.bucket
        # (tensors come from the buffers: no leaf of the first call is kept for them)
        constants = tuple(None if i in first.slots else x for i, x in enumerate(first.leaves))
        self.tree = CallTree(fn, constants, tuple(first.slots), first.spec)
        self.device = device = first.leaves[first.slots[0]].device
        self.platform = platform = options.platform or _platform_for(device)
        # The FULL graphs' outputs stay in the pool every graphed callable of the
        # platform captures into, and are lent from there (``graph_outputs``).
        self.lender: OutputLender = shared_lender(platform)
        self._message = _lent_message(fn)
        self._pool_outputs, self._upgrade_outputs = PoolOutputs(), PoolOutputs()
        self.runtime = _runtime(self._step, options, platform, self.lender, self._pool_outputs)
        # Without graphs every call runs on the caller's own tensors: no buffers.
        graphs = self.runtime.mode is not GraphMode.NONE
        self.rows = self.runtime.dispatcher.max_size if graphs else 0
        self.buffers = [  # [largest bucket, *shape past the batch]
            torch.zeros((self.rows, *shape), dtype=dtype, device=dev)
            for shape, dtype, dev in key[2]
        ]
        self._oversize: list[Any] | None = None  # a call above the largest bucket
        self._out_spec: TreeSpec | None = None
        staged = options.capture == "staged" and graphs
        # A staged signature's first stage graphs ``fn`` as it is; its upgrade compiles.
        self._compiled = None if staged else _compiled(self, options, platform)
        self.staged: StagedRuntime | None = None
        if options.check_padding and self.runtime.mode is not GraphMode.NONE:
            check_padding(self.fn, first)
        self._ready_lock = threading.Lock()
        self.ready = self._start_capture(wait=options.capture == "construction")

    def try_ready(self, wait: bool = False) -> bool:
        """Whether the signature's graphs are captured (or capturing in the background),
        capturing them now if the device is free (or once it is, with ``wait``); False
        while another signature's upgrade runs its compiler (a capture cannot overlap
        its synchronizations)."""
        if not self.ready:
            with self._ready_lock:
                self.ready = self.ready or self._start_capture(wait=wait)
        return self.ready

    def stats(self, key: str) -> SignatureStats:
        first = self.runtime.manager.stats()
        if self.staged is None:
            return SignatureStats(key, first)
        upgrade = self.staged.upgrade  # (read once: a failure drops it)
        upgraded = upgrade.manager.stats() if upgrade is not None else None
        return SignatureStats(key, first, self.staged.summary(), upgraded)

    def describe(self) -> str:
        shapes = ", ".join(f"{list(s)}:{str(d).removeprefix('torch.')}" for s, d, _ in self.key[2])
        return f"({shapes})" + (f" seq<={self.bucket}" if self.bucket else "")

    def run(self, call: _Call, full: bool = False) -> Any:
        """``call`` through its bucket's graph (``full``: the FULL graph of a mode that
        treats calls differently), under the pool's lock until its outputs are lent."""
        with self.lender.writing():
            if self.staged is not None:
                self.staged.advance()  # (one bucket of the upgrade, once it is compiled)
            stage = self.staged or self.runtime.manager  # (where the step runs)
            with torch.inference_mode(), stage.stepping():
                dispatch = (self.staged or self.runtime).dispatch(call.batch, uniform_decode=full)
                if self.options.capture == "background":
                    self._capture_next(dispatch)
                padded = dispatch.descriptor.num_tokens
                if padded > self.rows:
                    self._oversize = call.leaves
                else:
                    self._write(call, padded)
                try:
                    outs = stage.run(dispatch, call.batch)
                finally:
                    self._oversize = None
                return self._outputs(outs, call, eager=padded > self.rows)

    def release(self) -> None:
        self.lender.recall(owner=self)  # (the graphs their memory belongs to go)
        if self.staged is not None:
            self.staged.release()  # (the thread stopped, then both stages released)
        else:
            self.runtime.manager.release()

    def _start_capture(self, wait: bool) -> bool:
        """Captures the first graphs (and starts a staged upgrade); without ``wait``,
        only if no upgrade's thread holds the device. Returns whether it started."""
        if self.runtime.mode is GraphMode.NONE:
            return True
        if self.options.capture == "background":
            # One graph per call, on the caller's thread (``_capture_next``): a capture
            # on another thread would break the caller's own device synchronizations
            # and random numbers between calls.
            self.runtime.manager.capture_on_steps()
            return True
        if not _DEVICE.acquire(blocking=wait):
            return False
        try:
            with self.lender.writing():  # (its captures write the pool)
                self.runtime.manager.capture()
        finally:
            _DEVICE.release()
        if self.options.capture == "staged":
            # Captured on the caller's thread (advance): its code between calls may
            # synchronize the device or draw random numbers, which a capture on the
            # upgrade's thread would break.
            self.staged = StagedRuntime(
                self.runtime,
                self._build_upgrade,
                on_steps=True,
                device_lock=_DeviceThenOutputs(self.lender),
            )
        return True

    def _capture_next(self, dispatch: Dispatch) -> None:
        """``capture="background"``: one more graph before this call (its own bucket's
        first), unless another signature's compile holds the device. A failed capture
        is a warning: the graphs are released and the calls go on eagerly."""
        if not _DEVICE.acquire(blocking=False):
            return
        try:
            self.runtime.manager.capture_next(dispatch)
        except GraphCaptureError as exc:
            warnings.warn(
                f"ostinato.graphed: {self.describe()} runs eagerly from now on: {exc}",
                stacklevel=4,
            )
        finally:
            _DEVICE.release()

    def _build_upgrade(self) -> GraphRuntime:
        """The staged upgrade (on its thread): FULL graphs of ``fn`` compiled whole,
        reading the same buffers, in the first stage's pool."""
        compiler = self.options.compiler
        compiled = self.whole("inductor" if compiler == "auto" else compiler)

        def step(d: BatchDescriptor) -> tuple[torch.Tensor, ...]:
            outs, _ = tree_flatten(compiled(*(buf[: d.num_tokens] for buf in self.buffers)))
            return tuple(outs)

        config = dataclasses.replace(self.options.config, mode=GraphMode.FULL)
        # The first stage's pool: the two stages never replay at once (one caller's
        # thread), so the upgrade's graphs reuse the first stage's memory.
        first = self.runtime.manager
        self._upgrade_outputs = outputs = PoolOutputs()
        upgrade = build_graph_runtime(
            step, config, platform=self.platform, pool=first.pool, outputs=outputs
        )
        # Compiled here, not in the captures on the caller's thread: the largest bucket
        # (the dynamic batch) and the smallest (Dynamo specializes a batch of 1). Not
        # at a smaller batch: Inductor tunes the kernels to the first one's sizes (GPT-2
        # compiled at a batch of 2 ran 1.7x slower at 32).
        with _DEVICE, torch.inference_mode():
            for size in sorted({upgrade.dispatcher.max_size, min(config.sizes)}):
                step(BatchDescriptor(num_tokens=size))
        return upgrade

    def _write(self, call: _Call, padded: int) -> None:
        n, seq_dim = call.batch, self.options.seq_dim
        for buf, slot in zip(self.buffers, self.slots, strict=True):
            x = call.leaves[slot]
            if self.bucket and x.dim() > seq_dim:
                rows = buf[:n]
                rows.narrow(seq_dim, 0, call.length).copy_(x)
                rows.narrow(seq_dim, call.length, self.bucket - call.length).zero_()
            else:
                buf[:n].copy_(x)
            buf[n:padded].zero_()

    def _step(self, d: BatchDescriptor) -> tuple[torch.Tensor, ...]:
        if self._oversize is not None:  # above every bucket: the caller's own tensors
            tensors = [self._oversize[s] for s in self.slots]
        else:
            tensors = [buf[: d.num_tokens] for buf in self.buffers]
        call = self._compiled or self.tree
        outs, self._out_spec = tree_flatten(call(*tensors))
        return tuple(outs)

    def whole(self, compiler: str) -> WholeCompiled:
        """``fn`` compiled whole by ``compiler``, one compilation for this signature and
        those that differ from it only in their sequence bucket."""
        seq_dim = self.options.seq_dim if self.options.seq_buckets else None
        return self.compiles.whole(self.tree, self.key, compiler, seq_dim, self.device)

    def _from_graph(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is (a view of) an output of the first stage's graphs or the
        upgrade's (not of a step run eagerly)."""
        return self._pool_outputs.holds(t) or self._upgrade_outputs.holds(t)

    def _outputs(self, outs: Any, call: _Call, eager: bool) -> Any:
        """The caller's outputs: an ``eager`` call's (above every bucket) as ``fn``
        returned them; a FULL graph's lent (or copied, ``copy_outputs``); any other
        (pieces' outputs, which their next replay overwrites, or a step run eagerly inside
        the graphs' path, which may return views of the input buffers) copied."""
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        seq_dim = self.options.seq_dim
        for i, t in enumerate(outs):
            if self.bucket and t.dim() > seq_dim and t.shape[seq_dim] == self.bucket:
                t = t.narrow(seq_dim, 0, call.length)
            if eager:
                pass
            elif self.options.copy_outputs or not self._from_graph(t):
                t = t.clone()
            else:
                t = self.lender.lend(t, self.platform, self._message, owner=self)
            outs[i] = t
        assert self._out_spec is not None
        return tree_unflatten(outs, self._out_spec)


@dataclass(frozen=True)
class _DeviceThenOutputs:
    """A staged upgrade's device lock: ``_DEVICE``, then the lock of the pool the
    signatures share (an advance captures and times into it, also from
    ``wait_for_upgrades``, beside another thread's calls), in the order a first capture
    takes them; what was lent from it is recalled before the advance writes it."""

    lender: OutputLender

    def acquire(self, blocking: bool = True) -> bool:
        if not _DEVICE.acquire(blocking=blocking):
            return False
        if not self.lender.acquire(blocking=blocking):
            _DEVICE.release()
            return False
        return True

    def release(self) -> None:
        self.lender.release()
        _DEVICE.release()


def check_padding(fn: Callable[..., Any], call: _Call) -> None:
    """Runs ``fn`` eagerly on ``call``'s rows plus one padding row, once zeros and once
    other values; ``PaddingChangesRealRowsError`` if the real rows' outputs differ.
    Beyond the two answers it holds only float32 copies of a few rows at a time (a
    language model's logits in float64 whole took 9 GB at 33 rows of GPT-2)."""
    n = call.batch
    answers = []
    for fill in (_zeros_row, _other_row):
        leaves = list(call.leaves)
        for slot in call.slots:
            x = leaves[slot]
            leaves[slot] = torch.cat([x, fill(x)])
        args, kwargs = tree_unflatten(leaves, call.spec)
        with torch.inference_mode():
            answers.append(tree_flatten(fn(*args, **kwargs))[0])
    for i, (a, b) in enumerate(zip(*answers, strict=True)):
        if not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] != n + 1:
            raise ValueError(
                f"output #{i}: every output must be a tensor with the batch on dim 0 "
                f"({n + 1} rows for {n + 1} input rows), got {getattr(a, 'shape', type(a))}"
            )
        diff = real_rows_differ(a[:n], b[:n])
        if diff is not None:
            raise PaddingChangesRealRowsError(
                f"output #{i}: the real rows change (max |diff| {diff:.3g}) when the padding "
                "rows added to reach a bucket hold other values, so graphs would change "
                "fn's answers. Something mixes rows of the batch: a batch norm in training "
                "mode (call .eval()), or a reduction over dim 0. Fix the model, or pass "
                "check_padding=False if the mixing is intended."
            )


_CHUNK_ELEMENTS = 1 << 22  # float32 rows compared at once: 16 MiB a copy


def real_rows_differ(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """The largest ``|a - b|`` where ``a`` and ``b`` are not close (relative 1e-3 of each
    element, absolute 1e-3 of ``a``'s largest magnitude), else None. Compared in float32
    over chunks of rows, so memory stays bounded whatever the outputs' size."""
    if a.numel() == 0:
        return None
    rows = max(1, _CHUNK_ELEMENTS // max(1, a[:1].numel()))
    chunks = [(a[k : k + rows], b[k : k + rows]) for k in range(0, a.shape[0], rows)]
    scale = max(_wide(x).abs().max().item() for x, _ in chunks)
    atol = 1e-3 * max(scale, 1e-6)
    worst: float | None = None
    for x, y in chunks:
        x, y = _wide(x), _wide(y)
        if not torch.allclose(x, y, rtol=1e-3, atol=atol, equal_nan=True):
            d = (x - y).abs().max().item()
            worst = d if worst is None else max(worst, d)
    return worst


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.complex64) if x.is_complex() else x.float()


def _zeros_row(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x[:1])


def _other_row(x: torch.Tensor) -> torch.Tensor:
    if x.is_floating_point() or x.is_complex():
        return torch.randn_like(x[:1]) * (x.abs().max() + 1)
    return x[:1].clone() if bool(x[:1].any()) else torch.ones_like(x[:1])  # valid values


def _runtime(
    step: Any, options: _Options, platform: Platform, lender: OutputLender, outputs: PoolOutputs
) -> GraphRuntime:
    return build_graph_runtime(
        step,
        options.config,
        piecewise_available=bool(options.splitting_ops),
        platform=platform,
        pool=lender.pool,
        progress=options.progress,
        outputs=outputs,
    )


def _compiled(signature: _Signature, options: _Options, platform: Platform) -> Any:
    """The signature's function (every argument a tensor with the batch on dim 0)
    compiled: by the piecewise backend with ``splitting_ops``; whole by ``compiler`` when
    one was named (FULL graphs of its kernels, shared with the signatures that differ
    only in their bucket); else None (FULL graphs of ``fn``'s own kernels)."""
    if not platform.supports_graphs:
        return None
    if not options.splitting_ops:
        whole = options.compiler not in ("auto", None)
        return signature.whole(options.compiler) if whole else None
    from ostinato.piecewise import CompiledModel, PiecewiseBackend

    compiler = choose_compiler(options.compiler, options.config.mode, platform) or "eager"
    backend = PiecewiseBackend(options.splitting_ops, compiler=compiler, platform=platform)
    return CompiledModel(AsModule(signature.tree), backend)


def _lent_message(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return (
        f"this output of ostinato.graphed({name}) was lent until the next call of it or of "
        "any graphed callable on its device (the default, as reduce-overhead's outputs are), "
        "and a later call or release() has overwritten it; clone() what you keep before "
        "calling again, or pass copy_outputs=True"
    )


def _platform_for(device: torch.device) -> Platform:
    return CpuPlatform() if device.type == "cpu" else current_platform()


def _name(path: Any) -> str:
    """``args[0]['x']`` / ``kwargs['mask']`` for a leaf's path in ``(args, kwargs)``."""
    head, *rest = path
    root = "args" if getattr(head, "idx", None) == 0 else "kwargs"
    return root + keystr(tuple(rest))


def _same(what: str, name: str, t: torch.Tensor, dim: int, size: int | None) -> int:
    if t.dim() <= dim:
        raise ValueError(
            f"{name}: a tensor of shape {tuple(t.shape)} has no {what}; every tensor "
            "argument is batched on dim 0 (close over tensors shared by the batch)"
        )
    if size is not None and t.shape[dim] != size:
        raise ValueError(
            f"{name}: its {what} is {t.shape[dim]}, the arguments before it have {size}; "
            "every tensor argument must share it"
        )
    return t.shape[dim]


def _modes(
    splitting_ops: Sequence[str],
    mode: str | GraphMode,
    full_when: Callable[..., bool] | None,
    capture: str,
    compiler: str | None,
) -> tuple[tuple[str, ...], GraphMode, str]:
    """``graphed``'s splitting ops, resolved mode and capture, checked together (each
    depends on the ones before it)."""
    splitting = _check_ops(splitting_ops)
    resolved = _one_call_mode(mode, bool(splitting), full_when)
    when = _capture_when(capture, resolved, splitting, compiler)
    _check_staged(when, resolved, splitting, compiler)
    return splitting, resolved, when


def _one_call_mode(
    mode: str | GraphMode, has_splitting_ops: bool, full_when: Callable[..., bool] | None
) -> GraphMode:
    if isinstance(mode, str) and mode.strip().lower() == "auto":
        resolved = GraphMode.PIECEWISE if has_splitting_ops else GraphMode.FULL
    else:
        resolved = GraphMode.parse(mode)
    if resolved.separate_routine() and full_when is None:
        raise ValueError(
            f"mode: {resolved.name} replays FULL graphs for some calls and not for others; "
            "pass full_when=, a function of the call's arguments that says which calls "
            "may replay a FULL graph (or use 'full', 'piecewise' or 'auto')"
        )
    if full_when is not None and not resolved.separate_routine():
        raise ValueError(
            f"full_when: only used with mode 'full_and_piecewise' or 'full_decode_only', "
            f"not {resolved.name}"
        )
    if full_when is not None and not callable(full_when):
        raise TypeError(f"full_when: expected a function, got {type(full_when).__name__}")
    return resolved


def _check_buckets(buckets: Sequence[int] | None) -> tuple[int, ...]:
    if buckets is None:
        return ()
    if (
        isinstance(buckets, (str, bytes))
        or not isinstance(buckets, Sequence)
        or not all(is_int(b) and b >= 1 for b in buckets)
    ):
        raise TypeError(f"seq_buckets: expected positive ints, got {buckets!r}")
    dupes = repeated(buckets)
    if dupes:
        raise ValueError(f"seq_buckets: duplicate buckets {dupes}; list each length once")
    return tuple(sorted(buckets))


def _capture_when(
    capture: object, mode: GraphMode, splitting: tuple[str, ...], compiler: object
) -> str:
    """``capture`` checked, ``"auto"`` resolved: staged where FULL graphs of ``fn`` as it
    is can be upgraded to Inductor's (measured faster than graphs of eager kernels on
    every model of ``benchmarks/graphed_models``, but a compile of tens of seconds that
    the staged start keeps off the first calls); a compiler the caller named is used
    from the first graph."""
    capture = _check_choice("capture", capture, CAPTURE_WHEN)
    if capture != "auto":
        return capture
    staged = mode is GraphMode.FULL and not splitting and compiler == "auto"
    return "staged" if staged else "first_use"


def _check_staged(
    capture: object, mode: GraphMode, splitting: tuple[str, ...], compiler: str | None
) -> None:
    """``capture="staged"`` upgrades FULL graphs of ``fn`` to FULL graphs of ``fn``
    compiled whole: it needs that mode (``mode``: ``_one_call_mode``'s), no pieces, and a
    compiler."""
    if capture != "staged":
        return
    if splitting or mode is not GraphMode.FULL:
        raise ValueError(
            "capture: 'staged' upgrades FULL graphs of fn to FULL graphs of fn compiled "
            "whole; use mode 'auto' or 'full' without splitting_ops"
        )
    if compiler is None:
        raise ValueError(
            "compiler: capture='staged' compiles fn for its upgrade; use 'auto' (Inductor), "
            "'inductor' or 'eager', not None"
        )


def _artifact_store(
    cache_dir: object,
    fn: Callable[..., Any],
    splitting: tuple[str, ...],
    capture: str,
    compiler: str | None,
) -> ArtifactStore | None:
    """Where Inductor's whole compilations of ``fn`` are kept (``ArtifactStore.from_arg``).
    A folder named (or True) that would be ignored is refused by name: where nothing
    compiles ``fn`` whole with Inductor (a named compiler ``"inductor"``, or a staged
    upgrade's ``"auto"``; never with pieces), or where ``fn`` has no identity another
    process could find (a closure over a tensor: ``compile_artifacts.identity``)."""
    store = ArtifactStore.from_arg(cache_dir)
    if cache_dir in (None, False):
        return store  # (the default keeps what it can, silently where it cannot)
    inductor = compiler == "inductor" or (capture == "staged" and compiler == "auto")
    if splitting or not inductor:
        raise ValueError(
            f"cache_dir: nothing to keep: with compiler={compiler!r}, capture={capture!r}"
            f"{' and splitting_ops' if splitting else ''} fn is not compiled whole by "
            "Inductor; leave cache_dir out, or use compiler='inductor' without splitting_ops"
        )
    if identity(fn) is None:
        raise ValueError(
            "cache_dir: nothing to keep: fn has no name another process could find (it "
            "captures a value other than a module, a function or a constant, such as a "
            "tensor); capture the module instead, or leave cache_dir out"
        )
    return store


def _check_compiler(compiler: str | None) -> str | None:
    choose_compiler(compiler, None)  # refuses an unknown name
    return compiler


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name}: one of {', '.join(choices)}; got {value!r}")
    return str(value)


def _too_many(key: tuple[Any, ...], limit: int) -> str:
    shapes = [list(s) for s, _, _ in key[2]]
    return (
        f"graphed: a call with tensor shapes past the batch {shapes} would be signature "
        f"{limit + 1}, over max_signatures={limit}. Each signature (shapes past the "
        "dynamic dims, dtypes, devices, constant arguments) captures graphs of its own; "
        "make the varying dimension dynamic (seq_buckets), keep constants fixed, or "
        "raise max_signatures."
    )
