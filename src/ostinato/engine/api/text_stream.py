"""The text of a token stream as it grows, for the command line's streamed answer and the
server's streamed responses."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ostinato.engine.core.stop_text import StopText


class TextStream:
    """``push(tokens)`` returns the text the tokens add, or None while the text ends
    inside a multi-byte character (it comes with a later push); ``rest()`` is what was
    never returned. The pieces returned, then ``rest()``, add up to the text of the whole
    stream.

    A push decodes a window, not the stream: from the start of the piece returned before
    the last one, so that a token's text sees its left neighbours (a leading space, the
    first bytes of its character), and a push costs the same at token 10 and 10,000.

    With ``stop`` the pieces and the rest add up to the text before the first stop string
    instead: text that could begin one waits for the next push (``StopText.safe_end``)."""

    def __init__(
        self, decode: Callable[[Sequence[int]], str], stop: StopText | None = None
    ) -> None:
        self._decode, self._stop = decode, stop
        self.tokens: list[int] = []
        self._start = 0  # the window's first token
        self._read = 0  # tokens whose text was returned
        self._text, self._sent = "", 0  # with stop strings: the text so far, and returned

    def push(self, tokens: Sequence[int]) -> str | None:
        self.tokens.extend(tokens)
        shown = self._decode(self.tokens[self._start : self._read])
        text = self._decode(self.tokens[self._start :])
        if text.endswith("\ufffd"):
            return None
        self._start, self._read = self._read, len(self.tokens)
        return self._held(text[len(shown) :], at_end=False)

    def rest(self) -> str:
        shown = self._decode(self.tokens[self._start : self._read])
        return self._held(self._decode(self.tokens[self._start :])[len(shown) :], at_end=True)

    def _held(self, piece: str, at_end: bool) -> str:
        if self._stop is None:
            return piece
        self._text += piece
        if at_end:  # nothing more comes: only a whole stop string holds text back
            end = self._stop.first(self._text, self._sent)
            end = len(self._text) if end < 0 else end
        else:
            end = self._stop.safe_end(self._text, self._sent)
        piece, self._sent = self._text[self._sent : end], max(self._sent, end)
        return piece
