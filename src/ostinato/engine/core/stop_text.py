"""Stop strings: where a request's text reaches one of its ``SamplingParams.stop``.

``StopText`` serves the three places that need it: the scheduler ends a request at the
token whose text completes a stop string (``hit``, on the last tokens' text, so a stop
string spanning several tokens is found); the whole answer is cut before the first stop
string (``cut``); and a stream returns only text that no stop string can still claim
(``safe_end``: text that could be the start of a stop string waits for the next tokens).
The text returned never contains a stop string; the token ids do, up to the token that
completed it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]
SLACK_TOKENS = 4  # a window's tokens beyond one a character: tokens that add no text


class StopText:
    """The stop strings ``stops`` of one request, over text made by ``decode``."""

    def __init__(self, stops: Sequence[str], decode: Decode) -> None:
        if not stops or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop: non-empty strings, got {list(stops)!r}")
        self.stops, self._decode = tuple(stops), decode
        self.longest = max(len(s) for s in self.stops)

    def hit(self, output: Sequence[int]) -> bool:
        """Whether the text of ``output`` now holds a stop string. Reads the text of the
        last tokens only: one that completes a stop string lies within as many tokens as
        the string has characters (each token adds at least one, or a few add none)."""
        tail = self._decode(output[-(self.longest + SLACK_TOKENS) :])
        return any(s in tail for s in self.stops)

    def first(self, text: str, start: int = 0) -> int:
        """Where the first stop string in ``text`` (from ``start``) begins, or -1."""
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else -1

    def cut(self, text: str) -> str:
        """``text`` before its first stop string (whole when it has none)."""
        end = self.first(text)
        return text if end < 0 else text[:end]

    def safe_end(self, text: str, start: int = 0) -> int:
        """How much of ``text`` a stream may return: up to the first stop string (from
        ``start``, the end of what it returned), else up to the longest end of ``text``
        that begins a stop string."""
        end = self.first(text, start)
        if end >= 0:
            return end
        for keep in range(min(self.longest - 1, len(text)), 0, -1):
            if any(s.startswith(text[-keep:]) for s in self.stops):
                return len(text) - keep
        return len(text)
