"""``RequestOutput``: what ``LLM.generate`` returns for one prompt."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ostinato.engine.api.engine import Tracked
from ostinato.engine.core.logprob import TokenLogprob
from ostinato.engine.core.scheduler import FinishReason


@dataclass
class RequestOutput:
    """One prompt's result, in the order the prompts were given. ``text``: the tokens'
    text, ending before a stop string (None without a tokenizer). ``logprobs``: one per
    token of ``token_ids`` where ``SamplingParams.logprobs`` asked, else None."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    text: str | None = None
    request_id: str = ""  # the id given to generate, or the one it made up
    logprobs: list[TokenLogprob] | None = None

    @staticmethod
    def of(t: Tracked, decode: Callable[[Sequence[int]], str] | None) -> RequestOutput:
        """The output of the finished request ``t`` (``decode``: token ids to text)."""
        r, stop = t.request, t.request.stop_text
        text = decode(r.output) if decode is not None else None
        text = stop.cut(text) if stop is not None and text else text
        logprobs = list(r.logprobs) if r.params.logprobs is not None else None
        assert r.finish_reason is not None  # (finished)
        return RequestOutput(r.prompt, r.output, r.finish_reason, text, t.request_id, logprobs)
