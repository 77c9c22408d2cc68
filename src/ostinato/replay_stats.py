"""Live statistics per bucket: how often each captured size replays, how many of the rows
it computes are padding, how often a step ran eagerly and why, and what each capture cost.

``GraphManager.run`` records every step into a ``ReplayStats``; ``GraphManager.stats()``
returns a ``StatsSnapshot`` (data, and a one-line ``summary()``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ostinato.batch import BatchDescriptor
from ostinato.capture_report import CaptureReport
from ostinato.dispatcher import Dispatch
from ostinato.modes import GraphMode


class EagerReason(enum.Enum):
    """Why a step ran eagerly rather than from graphs."""

    ABOVE_LARGEST = "above the largest capture size"
    NO_GRAPH_FOR_BATCH = "no graph in this mode for this kind of batch"
    NOT_CAPTURED_YET = "its graph was still being captured"
    DEMOTED = "its graph was demoted after differing from eager"


@dataclass
class _Tally:  # mutable, one per Dispatch the manager has run
    steps: int = 0
    real_rows: int = 0


@dataclass(frozen=True)
class BucketStats:
    """One bucket (a captured descriptor and its mode) since the manager was built.

    ``padded_rows`` are the rows its replays computed (``replays * num_tokens``);
    ``real_rows`` the rows callers asked for; the rest is padding. ``capture_seconds``
    and ``pool_bytes`` come from the capture report (0 for a size not captured)."""

    descriptor: BatchDescriptor
    mode: GraphMode
    replays: int
    real_rows: int
    capture_seconds: float
    pool_bytes: int

    @property
    def padded_rows(self) -> int:
        """Rows computed by this bucket's replays."""
        return self.replays * self.descriptor.num_tokens

    @property
    def padding_fraction(self) -> float:
        """Share of computed rows that were padding (0 when it never replayed)."""
        return 1 - self.real_rows / self.padded_rows if self.padded_rows else 0.0


@dataclass(frozen=True)
class StatsSnapshot:
    """Every bucket (largest first within a mode), and the eager steps by reason.

    ``eager_rows`` counts the rows of eager steps, with padding where one ran at a padded
    size (a graph not captured yet). ``step_sizes`` is the histogram of real step sizes up
    to the largest capture size, however they ran: what ``capture_planner`` plans from."""

    buckets: tuple[BucketStats, ...]
    eager_steps: dict[EagerReason, int]
    eager_rows: int
    step_sizes: dict[int, int] = field(default_factory=dict)  # real rows -> steps (<= max)
    checked_replays: int = 0  # replays compared with an eager run while serving
    demoted: tuple[BatchDescriptor, ...] = ()  # buckets taken out of service, in order

    @property
    def replays(self) -> int:
        """Steps that ran from graphs (FULL replays and PIECEWISE steps)."""
        return sum(b.replays for b in self.buckets)

    @property
    def lora_replays(self) -> int:
        """Replays of graphs captured with LoRA (``BatchDescriptor.has_lora``)."""
        return sum(b.replays for b in self.buckets if b.descriptor.has_lora)

    @property
    def eager(self) -> int:
        """Steps that ran eagerly, for whatever reason."""
        return sum(self.eager_steps.values())

    @property
    def real_rows(self) -> int:
        """Rows callers asked for in replayed steps."""
        return sum(b.real_rows for b in self.buckets)

    @property
    def padded_rows(self) -> int:
        """Rows replayed steps computed."""
        return sum(b.padded_rows for b in self.buckets)

    @property
    def padding_fraction(self) -> float:
        """Share of the rows computed by replays that were padding."""
        padded = self.padded_rows
        return 1 - self.real_rows / padded if padded else 0.0

    def summary(self) -> str:
        """One line: replays, eager steps by reason, padding waste."""
        steps = self.replays + self.eager
        why = ", ".join(f"{n} {r.value}" for r, n in self.eager_steps.items() if n)
        eager = f"{self.eager} eager ({why})" if why else "0 eager"
        checks = ""
        if self.checked_replays or self.demoted:
            checks = f"; {self.checked_replays} checked, {len(self.demoted)} buckets demoted"
        lora = f" ({self.lora_replays} with LoRA)" if self.lora_replays else ""
        return (
            f"{steps} steps: {self.replays}{lora} from graphs over "
            f"{sum(1 for b in self.buckets if b.replays)} buckets, {eager}; padding "
            f"{self.padding_fraction:.1%} of replayed rows "
            f"({self.padded_rows - self.real_rows} of {self.padded_rows}){checks}"
        )


class ReplayStats:
    """The counters behind ``GraphManager.stats()``: ``record`` costs one dict lookup and
    three additions per step (the replay path)."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._graphs: dict[Dispatch, _Tally] = {}
        self._eager: dict[EagerReason, _Tally] = {r: _Tally() for r in EagerReason}
        self._sizes = [0] * (max_size + 2)  # [real rows]; the last counts every larger one
        self._checked = 0
        self._demoted: list[BatchDescriptor] = []

    def record(
        self,
        dispatch: Dispatch,
        num_tokens: int,
        ran: GraphMode,
        reason: EagerReason | None = None,
    ) -> None:
        """One step of ``num_tokens`` real rows dispatched as ``dispatch``; ``ran`` is the
        mode it actually ran in (NONE when its graph was not ready, or ``reason``)."""
        self._sizes[min(num_tokens, self.max_size + 1)] += 1
        if ran is GraphMode.NONE:
            tally = self._eager[reason or self._reason(dispatch, num_tokens)]
            tally.steps += 1
            tally.real_rows += dispatch.descriptor.num_tokens
            return
        tally = self._graphs.get(dispatch)
        if tally is None:
            tally = self._graphs[dispatch] = _Tally()
        tally.steps += 1
        tally.real_rows += num_tokens

    def _reason(self, dispatch: Dispatch, num_tokens: int) -> EagerReason:
        if dispatch.mode is not GraphMode.NONE:
            return EagerReason.NOT_CAPTURED_YET
        if num_tokens > self.max_size:
            return EagerReason.ABOVE_LARGEST
        return EagerReason.NO_GRAPH_FOR_BATCH

    def snapshot(self, captures: CaptureReport, keys: list[Dispatch]) -> StatsSnapshot:
        """The counters now, one bucket per key of ``keys`` (those never run included)."""
        cost = {(r.descriptor, r.mode): r for r in captures.records}
        graphs = dict(self._graphs)  # (a step on another thread may add a key meanwhile)
        buckets = []
        for key in [*keys, *(k for k in graphs if k not in keys)]:
            tally = graphs.get(key, _Tally())
            record = cost.get((key.descriptor, key.mode))
            buckets.append(
                BucketStats(
                    key.descriptor,
                    key.mode,
                    tally.steps,
                    tally.real_rows,
                    record.seconds if record else 0.0,
                    record.pool_bytes if record else 0,
                )
            )
        eager = {r: t.steps for r, t in self._eager.items()}
        rows = sum(t.real_rows for t in self._eager.values())
        sizes = {n: c for n, c in enumerate(self._sizes[: self.max_size + 1]) if c}
        return StatsSnapshot(
            tuple(buckets), eager, rows, sizes, self._checked, tuple(self._demoted)
        )

    def checked(self) -> None:
        """One replay compared with an eager run while serving."""
        self._checked += 1

    def demoted(self, descriptor: BatchDescriptor) -> None:
        """A bucket taken out of service."""
        self._demoted.append(descriptor)
