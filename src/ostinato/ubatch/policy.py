"""When a step is micro-batched: above a token threshold (decode-only steps and steps
with a prefill have their own), as vLLM does by default (32 and 512), and, for captured
FULL graphs, only where a measurement at capture says the split is faster."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatching:
    """Split steps of at least ``decode_threshold`` tokens (decode-only) or
    ``prefill_threshold`` tokens (with a prefill) into two micro-batches.

    ``measure`` (the default): every FULL size the thresholds select is captured both
    ways at start-up and replayed ``measure_repeats`` times each; it keeps its
    micro-batched graph only if that is at least ``min_speedup`` times faster than the
    plain one (on every rank of every data-parallel replica: the slowest rank's times
    decide, so all replicas split the same sizes).
    Without ``measure`` the thresholds alone decide. Eager steps (NONE mode) follow the
    thresholds either way: there is nothing captured to time.
    """

    decode_threshold: int = 32
    prefill_threshold: int = 512
    measure: bool = True
    min_speedup: float = 1.03
    measure_repeats: int = 10

    def __post_init__(self) -> None:
        for name in ("decode_threshold", "prefill_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError(f"micro_batching.{name}: must be an integer >= 2, got {value!r}")
        if not isinstance(self.measure, bool):
            raise ValueError(f"micro_batching.measure: must be a bool, got {self.measure!r}")
        speedup = self.min_speedup
        if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) or speedup <= 0:
            raise ValueError(
                f"micro_batching.min_speedup: must be a number > 0 (1.0 keeps any split "
                f"that is not slower), got {speedup!r}"
            )
        repeats = self.measure_repeats
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(
                f"micro_batching.measure_repeats: must be an integer >= 1, got {repeats!r}"
            )

    def applies(self, num_tokens: int, uniform_decode: bool) -> bool:
        """Whether a step of ``num_tokens`` (padded) tokens is micro-batched."""
        return num_tokens >= (self.decode_threshold if uniform_decode else self.prefill_threshold)
