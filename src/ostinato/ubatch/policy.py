"""When a step is micro-batched: above a token threshold (decode-only steps and steps
with a prefill have their own), as vLLM does by default (32 and 512)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatching:
    """Split steps of at least ``decode_threshold`` tokens (decode-only) or
    ``prefill_threshold`` tokens (with a prefill) into two micro-batches."""

    decode_threshold: int = 32
    prefill_threshold: int = 512

    def __post_init__(self) -> None:
        for name in ("decode_threshold", "prefill_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError(f"micro_batching.{name}: must be an integer >= 2, got {value!r}")

    def applies(self, num_tokens: int, uniform_decode: bool) -> bool:
        """Whether a step of ``num_tokens`` (padded) tokens is micro-batched."""
        return num_tokens >= (self.decode_threshold if uniform_decode else self.prefill_threshold)
