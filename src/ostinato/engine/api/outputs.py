"""``RequestOutput``: what ``LLM.generate`` returns for one prompt."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ostinato.engine.api.engine import Tracked
from ostinato.engine.core.logprob import TokenLogprob
from ostinato.engine.core.scheduler import FinishReason, Request


@dataclass
class RequestOutput:
    """One prompt's result, in the order the prompts were given. ``text``: the tokens'
    text, ending before a stop string (None without a tokenizer). ``logprobs``: one per
    token of ``token_ids`` where ``SamplingParams.logprobs`` asked, else None.
    ``others``: where ``SamplingParams.n`` asked for more than one sample, samples 2 to
    ``n`` (each an output of its own, with no ``others``); ``samples`` lists all ``n``."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    text: str | None = None
    request_id: str = ""  # the id given to generate, or the one it made up
    logprobs: list[TokenLogprob] | None = None
    others: tuple[RequestOutput, ...] = ()

    @property
    def samples(self) -> list[RequestOutput]:
        """Every sample of the prompt: this output, then ``others``."""
        return [self, *self.others]

    @staticmethod
    def of(t: Tracked, decode: Callable[[Sequence[int]], str] | None) -> RequestOutput:
        """The output of the finished request ``t`` and of the samples it leads
        (``decode``: token ids to text)."""
        first, *rest = (_sample(r, t.request_id, decode) for r in t.request.group)
        return replace(first, others=tuple(rest))


def _sample(
    r: Request, request_id: str, decode: Callable[[Sequence[int]], str] | None
) -> RequestOutput:
    stop = r.stop_text
    text = decode(r.output) if decode is not None else None
    text = stop.cut(text) if stop is not None and text else text
    logprobs = list(r.logprobs) if r.params.logprobs is not None else None
    assert r.finish_reason is not None  # (finished)
    return RequestOutput(r.prompt, r.output, r.finish_reason, text, request_id, logprobs)
