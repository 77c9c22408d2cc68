"""The text of a token stream as it grows, for the command line's streamed answer and the
server's streamed responses."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    """``push(token)`` returns the text the token adds, or None while the text ends
    inside a multi-byte character (the rest comes with a later token); ``rest()`` is
    what was never returned. Decodes the whole stream each time: a token's text depends
    on its neighbours."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.tokens: list[int] = []
        self._shown = ""

    def push(self, token: int) -> str | None:
        self.tokens.append(token)
        text = self._decode(self.tokens)
        if text.endswith("\ufffd"):
            return None
        delta, self._shown = text[len(self._shown) :], text
        return delta

    def rest(self) -> str:
        return self._decode(self.tokens)[len(self._shown) :]
