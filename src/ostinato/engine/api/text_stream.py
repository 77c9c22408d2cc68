"""The text of a token stream as it grows, for the command line's streamed answer and the
server's streamed responses."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    """``push(tokens)`` returns the text the tokens add, or None while the text ends
    inside a multi-byte character (it comes with a later push); ``rest()`` is what was
    never returned. The pieces returned, then ``rest()``, add up to the text of the whole
    stream.

    A push decodes a window, not the stream: from the start of the piece returned before
    the last one, so that a token's text sees its left neighbours (a leading space, the
    first bytes of its character), and a push costs the same at token 10 and 10,000."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.tokens: list[int] = []
        self._start = 0  # the window's first token
        self._read = 0  # tokens whose text was returned

    def push(self, tokens: Sequence[int]) -> str | None:
        self.tokens.extend(tokens)
        shown = self._decode(self.tokens[self._start : self._read])
        text = self._decode(self.tokens[self._start :])
        if text.endswith("\ufffd"):
            return None
        self._start, self._read = self._read, len(self.tokens)
        return text[len(shown) :]

    def rest(self) -> str:
        shown = self._decode(self.tokens[self._start : self._read])
        return self._decode(self.tokens[self._start :])[len(shown) :]
