"""Log probabilities (``TokenLogprob``) in OpenAI's shapes: chat's ``logprobs.content``
entries, and the completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset`` lists."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ostinato.engine.core.logprob import TokenLogprob

TokenText = Callable[[int], str]
"""A token's text, as the ``token`` fields show it."""


class LogprobShapes:
    """One request's log probabilities in its route's shape, piece by piece (a stream's
    events, or the whole answer at once); the completions' ``text_offset`` runs on
    across pieces from ``offset`` (the text before the first token: an echoed prompt)."""

    def __init__(self, chat: bool, text: TokenText, offset: int = 0) -> None:
        self.chat, self.text, self.offset = chat, text, offset

    def piece(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The ``logprobs`` of a choice (or a chunk's choice) holding ``entries``."""
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens, offsets = [], []
        for e in entries:
            token = self.text(e.token_id)
            tokens.append(token)
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.text(i): v for i, v in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _chat_entry(self, e: TokenLogprob) -> dict[str, Any]:
        top = [self._token(i, v) for i, v in e.top]
        return {**self._token(e.token_id, e.logprob), "top_logprobs": top}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
