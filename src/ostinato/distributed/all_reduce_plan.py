"""Which all-reduce algorithm serves a message of a given size: NCCL, or PyTorch's
symmetric-memory one-shot or two-shot all-reduce. The choice is a table of size buckets,
built from timings measured on the ranks themselves (``AllReducePlan.from_timings``) or
forced by the user (``AllReducePlan.only``).

Pure data and arithmetic, so it is tested on the CPU; the measuring and the kernels live in
``symm_all_reduce``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import Enum


class AllReduceAlgo(Enum):
    """An all-reduce algorithm. The symmetric-memory ones need the message in a buffer
    every rank mapped (no NVLink multicast is used)."""

    NCCL = "nccl"
    ONE_SHOT = "one-shot"  # every rank reads every peer's buffer and sums: 1 round
    TWO_SHOT = "two-shot"  # reduce-scatter then all-gather through the buffers: 2 rounds


ALL_REDUCE_CHOICES = ("auto", "nccl", "one-shot", "two-shot")
"""Values of the engine's ``all_reduce`` option: ``auto`` measures at start-up."""


def parse_all_reduce(value: str) -> str:
    """``value`` if it is one of ``ALL_REDUCE_CHOICES``; ``ValueError`` naming them if not."""
    if value not in ALL_REDUCE_CHOICES:
        raise ValueError(f"all_reduce: {value!r} is not one of {', '.join(ALL_REDUCE_CHOICES)}")
    return value


@dataclass(frozen=True)
class AllReducePlan:
    """``algos[i]`` serves messages of up to ``max_bytes[i]`` bytes (ascending); larger
    messages, and messages that are not a multiple of 16 bytes (the symmetric-memory
    kernels' alignment), go to NCCL."""

    max_bytes: tuple[int, ...]
    algos: tuple[AllReduceAlgo, ...]

    def __post_init__(self) -> None:
        if len(self.max_bytes) != len(self.algos):
            raise ValueError("AllReducePlan: one algorithm per size bucket")
        if list(self.max_bytes) != sorted(set(self.max_bytes)):
            raise ValueError(f"AllReducePlan: bucket sizes must ascend, got {self.max_bytes}")

    @staticmethod
    def nccl() -> AllReducePlan:
        """NCCL for every size."""
        return AllReducePlan((), ())

    @staticmethod
    def only(algo: AllReduceAlgo, buffer_bytes: int) -> AllReducePlan:
        """``algo`` for every message that fits ``buffer_bytes``, NCCL above."""
        return AllReducePlan((buffer_bytes,), (algo,))

    @staticmethod
    def from_timings(
        sizes: list[int], timings_us: dict[AllReduceAlgo, list[float]]
    ) -> AllReducePlan:
        """The fastest algorithm at each measured size serves the sizes up to it (above
        the previous measured size); NCCL above the largest. Adjacent buckets with the
        same winner merge. A plan made only of NCCL buckets is ``nccl()``."""
        if sizes != sorted(set(sizes)) or not sizes:
            raise ValueError(f"from_timings: sizes must be ascending and distinct, got {sizes}")
        for algo, times in timings_us.items():
            if len(times) != len(sizes):
                raise ValueError(
                    f"from_timings: {algo.value} has {len(times)} timings for {len(sizes)} sizes"
                )
        bounds: list[int] = []
        algos: list[AllReduceAlgo] = []
        for i, size in enumerate(sizes):
            # Ties go to the earlier algorithm in the dict (callers list NCCL first).
            best = min(timings_us, key=lambda a: timings_us[a][i])
            if algos and algos[-1] is best:
                bounds[-1] = size
            else:
                bounds.append(size)
                algos.append(best)
        while algos and algos[-1] is AllReduceAlgo.NCCL:  # NCCL is the default above
            algos.pop()
            bounds.pop()
        return AllReducePlan(tuple(bounds), tuple(algos))

    def choose(self, nbytes: int) -> AllReduceAlgo:
        """The algorithm for a message of ``nbytes`` bytes."""
        if nbytes % 16:
            return AllReduceAlgo.NCCL
        i = bisect.bisect_left(self.max_bytes, nbytes)
        return self.algos[i] if i < len(self.algos) else AllReduceAlgo.NCCL

    @property
    def uses_symmetric_memory(self) -> bool:
        """Whether any size goes through the symmetric-memory buffer."""
        return any(a is not AllReduceAlgo.NCCL for a in self.algos)

    def describe(self) -> str:
        """One line: ``one-shot <= 64 KiB, two-shot <= 8 MiB, nccl above``."""
        parts = [
            f"{a.value} <= {_human(b)}" for b, a in zip(self.max_bytes, self.algos, strict=True)
        ]
        return ", ".join([*parts, "nccl above" if parts else "nccl"])


def _human(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"
