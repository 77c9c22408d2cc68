"""Checking what a caller hands ``LLM.generate``: prompts (text or token ids), sampling
parameters, and the model length, with errors that name the prompt and the fix."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ostinato.engine.core.params import SamplingParams
from ostinato.engine.model.config import ModelConfig
from ostinato.mathutil import is_int

Prompt = Sequence[int] | str


def check_prompts(
    prompts: Sequence[Prompt],
    tokenizer: Any,
    vocab_size: int,
    fits: Callable[[list[int]], None],
) -> list[list[int]]:
    """Each prompt as token ids (text encoded with ``tokenizer``), all checked before any
    is used: ``TypeError`` / ``ValueError`` naming the prompt and the problem (bad types,
    ids outside ``[0, vocab_size)``, or what ``fits`` (the scheduler's check) refuses)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(
            f"prompts: expected a list of prompts, got {type(prompts).__name__}; "
            "wrap a single prompt in a list: generate([prompt])"
        )
    if prompts and all(is_int(t) for t in prompts):
        raise TypeError(
            "prompts: got a flat list of ints; wrap one prompt's token ids in a list: "
            "generate([[1, 2, 3]])"
        )
    out = []
    for i, p in enumerate(prompts):
        tokens = _encode(i, p, tokenizer)
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
            )
        try:
            fits(tokens)
        except ValueError as exc:
            raise ValueError(str(exc).replace("prompt:", f"prompt {i}:", 1)) from None
        out.append(tokens)
    return out


def _encode(i: int, prompt: Prompt, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                f"prompt {i}: text given but the model has no tokenizer; pass token ids"
            )
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"prompt {i}: text that is not valid Unicode ({exc.reason} at character "
                f"{exc.start}: {prompt[exc.start : exc.end]!r}); decode the bytes it came from "
                "with errors='replace', or pass token ids"
            ) from None
        return list(tokenizer.encode(prompt))
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(
            f"prompt {i}: expected a list of token ids or a string, got {type(prompt).__name__}"
        )
    for j, t in enumerate(prompt):
        if not is_int(t):
            raise TypeError(f"prompt {i}: token {j} is {t!r}, not an int")
    return [int(t) for t in prompt]


def check_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt; ``TypeError`` / ``ValueError`` naming the problem."""
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (list, tuple)):
        if len(params) != n:
            raise ValueError(f"params: {len(params)} given for {n} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}]: expected SamplingParams, got {type(p).__name__}")
        return list(params)
    raise TypeError(
        f"params: expected SamplingParams or a list of them, got {type(params).__name__}; "
        "build one with SamplingParams(max_tokens=...)"
    )


def model_len(requested: int | None, config: ModelConfig) -> int:
    """``max_model_len``: the requested value if the model's positions (with RoPE
    scaling) allow it, else ``ValueError``; by default ``min(1024, positions)``."""
    limit = config.max_position_embeddings
    if config.rope_scaling is not None:
        s = config.rope_scaling
        limit = max(limit, int(s.factor * s.original_max_position_embeddings))
    if requested is None:
        return min(1024, limit)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"max_model_len: must be a positive integer, got {requested!r}")
    if requested > limit:
        raise ValueError(
            f"max_model_len: {requested} exceeds the {limit} positions the model supports "
            "(max_position_embeddings and RoPE scaling); lower it"
        )
    return requested


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of ``messages`` in ``tokenizer``'s chat template, ready to answer."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise ValueError("chat: each conversation is a list of {'role': ..., 'content': ...} dicts")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Text of ``token_ids`` (special tokens dropped); ``ValueError`` without a tokenizer."""
    if tokenizer is None:
        raise ValueError("decode: the model has no tokenizer")
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)
