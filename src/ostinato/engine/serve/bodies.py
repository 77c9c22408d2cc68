"""The request bodies of the OpenAI routes, and what the server refuses in them.

Every field is typed strictly (``stream`` a bool, ``max_tokens`` an int, ``temperature`` a
number and never a string, a message's role one of system / developer / user / assistant)
and any field not named here is refused, so nothing a client sends is silently ignored;
``null`` stands for a field's default, as in OpenAI's API. OpenAI fields whose effect
this server does not give yet (``NOT_HONOURED``) are declared so that a request asking
for that effect is refused by name (``refusal``); their no-op values, which clients send
by default (``stop: null``, ``presence_penalty: 0``, ``response_format: {"type":
"text"}``, ...), are accepted, since the answer is then exactly what they ask for. A
field that contradicts another (``stream_options`` without ``stream``) is refused too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ostinato.engine.core.params import MAX_LOGPROBS, MAX_SAMPLES

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class RequestBody(BaseModel):
    """The fields both OpenAI routes take, strictly typed (no string for a number, no
    number for a bool); an unknown field is refused by name."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    # (StrictFloat: an int or a float, never a string or a bool)
    temperature: StrictFloat = Field(default=1.0, ge=0)
    top_p: StrictFloat = Field(default=1.0, gt=0, le=1)
    n: StrictInt = Field(default=1, ge=1, le=MAX_SAMPLES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # (vLLM's extension: generate max_tokens whatever comes)
    # (vLLM's extension: the answer ends where one of these tokens comes, finish reason stop)
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    user: str | None = None  # the end user's id for the client's records: nothing depends on it
    seed: StrictInt | None = Field(default=None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = Field(default=None, max_length=4)  # (OpenAI's at most 4)
    logit_bias: dict[str, StrictFloat] | None = None  # token id (as a string) -> bias
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2, le=2)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        """``"temperature": null`` and the like mean the field's default, as OpenAI reads
        them (clients built from its schema send them)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or fields[k].default is None
        }

    def contradiction(self) -> tuple[str, str] | None:
        """(field, message) where one field asks for what another rules out; None
        where the fields agree."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options: only with stream: true"
        return None

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


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_shape(value: Any) -> str | list[int] | list[str] | list[list[int]]:
    """One of OpenAI's four shapes of a completion's prompt, as given: a text, token ids,
    a list of texts, or a list of token-id lists (an empty list is an empty prompt)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if all(_is_id(v) for v in value) or all(isinstance(v, str) for v in value):
            return value
        if all(isinstance(v, list) and all(_is_id(t) for t in v) for v in value):
            return value
    raise PydanticCustomError(
        "prompt_shape",
        "a text, a list of token ids, a list of texts or a list of token-id lists",
    )


def _message_text(value: Any) -> str:
    """A message's content: a text, or OpenAI's list of text parts, joined by newlines
    (as vLLM joins them); a part of any other type is refused by its place."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise PydanticCustomError("content", "a text or a list of text parts")
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise PydanticCustomError(
                "content_part",
                "part {i}: '{kind}' parts are not supported (text only)",
                {"i": i, "kind": str(kind)},
            )
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise PydanticCustomError(
                "content_part",
                "part {i}: a text part holds 'type': 'text' and a string 'text', nothing else",
                {"i": i},
            )
        texts.append(part["text"])
    return "\n".join(texts)


class CompletionBody(RequestBody):
    """A ``/v1/completions`` body: one prompt or a list (texts or token ids)."""

    prompt: Annotated[str | list[int] | list[str] | list[list[int]], PlainValidator(_prompt_shape)]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    # Not honoured yet (``NOT_HONOURED``): accepted at their no-op values only.
    suffix: str | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per engine request (a list of texts or of token-id lists
        is several; its choices come prompt by prompt, ``n`` each)."""
        p = self.prompt
        if isinstance(p, str) or not p or _is_id(p[0]):
            return [p]
        return list(p)

    def asked_logprobs(self) -> int | None:
        """The alternatives per token asked for (0: the chosen token's only), or None for
        no log probabilities; ValueError with ``echo``."""
        if self.logprobs is not None and self.echo:
            raise ValueError(
                "logprobs: not with echo (the prompt's log probabilities are not computed)"
            )
        return self.logprobs


class ChatMessage(BaseModel):
    """One message of a chat: a known role and its text (a string or text parts)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, PlainValidator(_message_text)]

    def for_template(self) -> dict[str, str]:
        """The message as the chat template reads it: ``developer`` (OpenAI's newer name
        for the system's instructions) as ``system``, which templates know."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content}


class ChatBody(RequestBody):
    """A ``/v1/chat/completions`` body: at least one message."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Not honoured yet (``NOT_HONOURED``): accepted at their no-op values only.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None

    def asked_logprobs(self) -> int | None:
        """The alternatives per token asked for (``top_logprobs``, 0 if not given) where
        ``logprobs`` is true, else None; ValueError for ``top_logprobs`` without it."""
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
