"""Speculative decoding: proposers of draft tokens, and their verification.

A step verifies each drafting request's last token plus ``k`` proposed tokens in one
forward pass, then keeps the longest prefix of the draft the target agrees with and one
token more, so a step can yield up to ``k + 1`` tokens per request. Every proposer here is
deterministic (a point mass over its draft), so verification is exact for any sampling:
greedy requests keep draft tokens while they equal the target's argmax; sampled requests
keep draft token ``d`` with probability ``p(d)`` under the target's (temperature, top-p)
distribution, and on a rejection draw from ``p`` with ``d`` removed, renormalised, which
is standard speculative sampling with ``q = δ_d`` and leaves the output distribution
exactly ``p``.

Proposers: ``NgramProposer`` (prompt lookup: the tokens that followed the latest earlier
occurrence of the request's last n tokens), ``OracleProposer`` (tokens known in advance,
for measuring the verify path without draft cost), and ``SelfDraftProposer`` (the
target's first N layers with its final norm and LM head, run greedily ``k`` times).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ostinato.engine.core.scheduler import Request

METHODS = ("ngram", "self", "oracle")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``"ngram"``, ``"self"`` (with ``draft_layers``) or ``"oracle"`` (with
    ``oracle``: prompt token ids -> the tokens known to follow); ``k`` draft tokens per
    step; ``draft_graphs=False`` runs the self-draft's loop eagerly (for comparison)."""

    method: str
    k: int = 2
    draft_layers: int = 0
    oracle: Mapping[tuple[int, ...], Sequence[int]] | None = field(default=None, repr=False)
    ngram_max: int = 3
    draft_graphs: bool = True  # self-draft: replay the k-step loop from graphs (on CUDA)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative: method {self.method!r} is not one of {', '.join(METHODS)}"
            )
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= 16:
            raise ValueError(f"speculative: k must be an integer in 1..16, got {self.k!r}")
        if self.method == "self" and self.draft_layers < 1:
            raise ValueError("speculative: self-draft needs draft_layers >= 1 (self:N)")
        if self.method == "oracle" and self.oracle is None:
            raise ValueError("speculative: the oracle proposer needs the known tokens (oracle=)")

    @staticmethod
    def parse(text: str, k: int = 2) -> SpeculativeConfig:
        """``"ngram"``, ``"self:N"`` (the first N layers draft) with ``k`` draft tokens."""
        method, _, arg = text.partition(":")
        if method == "self":
            if not arg.isdigit():
                raise ValueError(f"speculative: {text!r}: write self:N, N the draft's layers")
            return SpeculativeConfig("self", k, draft_layers=int(arg))
        if arg:
            raise ValueError(f"speculative: {text!r}: only self takes an argument (self:N)")
        return SpeculativeConfig(method, k)


class NgramProposer:
    """Prompt lookup: finds the latest earlier occurrence of the request's last ``m``
    tokens (``m`` from ``max_n`` down to 1) and proposes the tokens that followed it."""

    def __init__(self, max_n: int = 3) -> None:
        self.max_n = max_n

    def __call__(self, requests: list[Request], n: list[int]) -> list[list[int]]:
        return [self.propose(r.tokens, k) for r, k in zip(requests, n, strict=True)]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest recent repeat of the suffix."""
        for m in range(min(self.max_n, len(tokens) - 1), 0, -1):
            suffix = tokens[-m:]
            for start in range(len(tokens) - m - 1, -1, -1):
                if tokens[start : start + m] == suffix:
                    return tokens[start + m : start + m + k]
        return []


class OracleProposer:
    """Proposes the tokens known to follow each prompt (a benchmark's reference run).

    ``known`` is kept by reference and read at every call, so a caller may update it
    between ``generate`` calls (a benchmark swaps in the reference run of each batch size:
    on a GPU, plain decoding's rounding, and so its tokens, can depend on the batch)."""

    def __init__(self, known: Mapping[tuple[int, ...], Sequence[int]]) -> None:
        self.known = known

    def __call__(self, requests: list[Request], n: list[int]) -> list[list[int]]:
        out = []
        for r, k in zip(requests, n, strict=True):
            future = self.known.get(tuple(r.prompt), ())
            out.append(list(future[len(r.output) : len(r.output) + k]))
        return out

    def window(self, requests: list[Request], k: int) -> list[list[int]]:
        """For requests whose verify step (drafts from ``len(output)``) is still on the
        device: the ``2k`` known tokens after its first, so that the next draft, if that
        step accepts ``a`` drafts, is ``window[a : a + k]`` (padded with the last one)."""
        out = []
        for r in requests:
            future = self.known.get(tuple(r.prompt), ())
            start = len(r.output) + 1
            w = list(future[start : start + 2 * k])
            fill = w[-1] if w else (r.output[-1] if r.output else r.prompt[-1])
            out.append(w + [fill] * (2 * k - len(w)))
        return out


@dataclass
class SpeculativeStats:
    """Counts over the engine's life: draft tokens proposed and accepted, verify
    (target) steps per request, the tokens those steps produced, and the verify steps
    scheduled ahead (``spec.ahead.VerifyAheadLoop``)."""

    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    tokens: int = 0
    ahead_steps: int = 0  # verify steps queued while the one before was on the device

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed ones."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verification(self) -> float:
        """Tokens a request gained per target step that verified its draft."""
        return self.tokens / self.verifications if self.verifications else 0.0
