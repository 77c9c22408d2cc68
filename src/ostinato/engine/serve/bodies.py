"""The request bodies of the OpenAI routes, and what the server refuses in them.

Every field is typed strictly (``stream`` a bool, ``max_tokens`` an int, a message's role
one of system / user / assistant) and any field not named here is refused, so nothing a
client sends is silently ignored. OpenAI fields whose effect this server does not give
yet (``NOT_HONOURED``) are declared so that a request asking for that effect is refused
by name (``refusal``); their no-op values, which clients send by default (``stop: null``,
``presence_penalty: 0``, ``response_format: {"type": "text"}``, ...), are accepted, since
the answer is then exactly what they ask for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ostinato.engine.core.params import MAX_LOGPROBS, MAX_SAMPLES

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: StrictInt = Field(default=1, ge=1, le=MAX_SAMPLES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # (vLLM's extension: generate max_tokens whatever comes)
    user: str | None = None  # the end user's id for the client's records: nothing depends on it
    seed: StrictInt | None = Field(default=None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = Field(default=None, max_length=4)  # (OpenAI's at most 4)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)

    def asked_logprobs(self) -> int | None:
        """``SamplingParams.logprobs`` as the body asks (None: no log probabilities);
        ``ValueError`` naming the field where they cannot be given."""
        return None

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; ``ValueError`` for a key that is no
        token id."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias: keys are token ids, got {key!r}")
            pairs.append((int(key), value))
        return tuple(pairs)

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty strings dropped: they stop nothing)."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(s for s in stops if s)

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens``, or its alias ``max_tokens`` (None: neither given);
        ``ValueError`` where both are given and differ."""
        a, b = self.max_completion_tokens, self.max_tokens
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"max_completion_tokens: {a} and its alias max_tokens: {b} differ; give one"
            )
        return a if a is not None else b


class CompletionBody(RequestBody):
    prompt: str | list[StrictInt]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    # Not honoured yet (``NOT_HONOURED``): accepted at their no-op values only.
    suffix: str | None = None
    best_of: StrictInt | None = None

    def asked_logprobs(self) -> int | None:
        if self.logprobs is not None and self.echo:
            raise ValueError(
                "logprobs: not with echo (the prompt's log probabilities are not computed)"
            )
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Not honoured yet (``NOT_HONOURED``): accepted at their no-op values only.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None

    def asked_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


def _no_op(value: Any) -> bool:
    return value in (None, False, 0, "", [], {})


# field -> (whether a value asks for an effect, what the server does not do)
NOT_HONOURED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (lambda v: not _no_op(v), "suffixes (insertion)"),
    "best_of": (lambda v: v not in (None, 1), "best-of sampling"),
    "tools": (lambda v: not _no_op(v), "tool calls"),
    "tool_choice": (lambda v: v not in (None, "none"), "tool calls"),
    "parallel_tool_calls": (lambda v: bool(v), "tool calls"),
    "response_format": (
        lambda v: v is not None and v != {"type": "text"},
        "structured output (response_format other than text)",
    ),
}


def refusal(body: RequestBody) -> tuple[str, str] | None:
    """The first field of ``body`` that asks for an effect this server does not give,
    and the message naming it; None where every field is honoured."""
    for name, (asks, what) in NOT_HONOURED.items():
        if name in type(body).model_fields and asks(getattr(body, name)):
            return name, f"{name}: not supported by this server ({what}); leave it out"
    return None


class LoadLoraBody(BaseModel):
    """``POST /v1/load_lora_adapter``: vLLM's body (its ``load_inplace`` is refused as an
    unknown field: a loaded name is unloaded first)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr = Field(min_length=1)
    lora_path: StrictStr = Field(min_length=1)


class UnloadLoraBody(BaseModel):
    """``POST /v1/unload_lora_adapter``: the adapter's name (vLLM's ``lora_int_id`` is
    refused as an unknown field)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr = Field(min_length=1)
