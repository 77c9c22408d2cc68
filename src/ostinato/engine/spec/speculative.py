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
occurrence of the request's last n tokens), ``SelfDraftProposer`` (the target's first N
layers with its final norm and LM head, run greedily ``k`` times), and any deterministic
``Proposal`` of the caller's (``SpeculativeConfig("custom", proposer=...)``: the
benchmarks' oracle, which drafts tokens known in advance, is one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only: the command line parses --speculative without torch)
    from ostinato.engine.core.scheduler import Proposal, Request

METHODS = ("ngram", "self", "custom")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``"ngram"``, ``"self"`` (with ``draft_layers``) or ``"custom"`` (with
    ``proposer``: a deterministic ``Proposal``, called with a step's drafting requests and
    the room each has, on the engine's thread between steps); ``k`` draft tokens per
    step; ``draft_graphs=False`` runs the self-draft's loop eagerly (for comparison)."""

    method: str
    k: int = 2
    draft_layers: int = 0
    proposer: Proposal | None = field(default=None, repr=False)
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
        if (self.method == "custom") != (self.proposer is not None):
            raise ValueError(
                "speculative: a proposer is given with method 'custom', and only then "
                "(SpeculativeConfig('custom', k, proposer=...))"
            )
        if self.proposer is not None and not callable(self.proposer):
            raise TypeError(
                "speculative: proposer must be callable as proposer(requests, room) -> drafts"
            )

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


@dataclass
class SpeculativeStats:
    """Counts over the engine's life: draft tokens proposed and accepted, verify
    (target) steps per request, and the tokens those steps produced."""

    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed ones."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verification(self) -> float:
        """Tokens a request gained per target step that verified its draft."""
        return self.tokens / self.verifications if self.verifications else 0.0
