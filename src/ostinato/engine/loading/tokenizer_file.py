"""A tokenizer read from a model-cache entry without importing transformers.

transformers' fast tokenizers are the ``tokenizers`` library's ``tokenizer.json`` plus a
chat template rendered by jinja2; importing transformers to get them costs seconds (4 s on
a development machine, about 8 s on the H200 host: it imports ``torch.distributed.fsdp``
and Dynamo). ``load_tokenizer`` builds ``TokenizerFile`` from those two libraries where
the entry is one it reproduces exactly, and otherwise (no ``tokenizer.json``, a template
jinja2 alone cannot parse, clean-up of decoded spaces that the installed transformers
would apply) returns None so that the caller uses transformers.

Guarantees, for the entries it accepts: ``encode`` and ``decode`` give the ids and text
transformers gives for the same folder (``tokenizers`` does the work in both), and
``apply_chat_template(messages, add_generation_prompt=..., tokenize=False)`` renders the
template in the sandboxed environment transformers uses (``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson``
that keeps non-ASCII text), with the special tokens in its context. The tests check both
against transformers on SmolLM2's entry.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerFile:
    """``tokenizer.json`` and a chat template (see the module docstring)."""

    def __init__(self, tokenizer: Any, template: Any, chat_template: str | None, special: dict):
        self._tokenizer = tokenizer
        self._template = template
        self.chat_template = chat_template
        self._special = special
        for name, value in special.items():
            setattr(self, name, value)
        eos = special.get("eos_token")
        self.eos_token_id = tokenizer.token_to_id(eos) if eos else None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled without the compiled template (jinja's are not picklable), which is
        # compiled again from its source: the server hands this to its HTTP process.
        return _rebuild, (self._tokenizer, self.chat_template, self._special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        """``messages`` rendered by the chat template (ids with ``tokenize``, as
        transformers, without special tokens added)."""
        if self._template is None:
            raise ValueError("apply_chat_template: this tokenizer has no chat template")
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{**self._special, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _rebuild(tokenizer: Any, chat_template: str | None, special: dict) -> TokenizerFile:
    template = _compile(chat_template) if chat_template else None
    return TokenizerFile(tokenizer, template, chat_template, special)


def load_tokenizer(folder: Path) -> TokenizerFile | None:
    """``TokenizerFile`` of ``folder`` (a model-cache entry's tokenizer), or None where it
    would not reproduce transformers (the caller then loads transformers')."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if config.get("clean_up_tokenization_spaces") and _cleans_up(path):
        return None  # transformers would rewrite decoded text; leave that to it
    special = {k: _token_text(config.get(k)) for k in _SPECIAL if config.get(k) is not None}
    chat_template = config.get("chat_template")
    jinja_file = folder / "chat_template.jinja"
    if chat_template is None and jinja_file.is_file():
        chat_template = jinja_file.read_text()
    if chat_template is not None and not isinstance(chat_template, str):
        return None  # several named templates: transformers chooses among them
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))
        template = _compile(chat_template) if chat_template else None
    except Exception:  # an unreadable file or a template needing transformers' extensions
        return None
    return TokenizerFile(tokenizer, template, chat_template, special)


def _cleans_up(tokenizer_json: Path) -> bool:
    """Whether the installed transformers applies ``clean_up_tokenization_spaces`` to this
    tokenizer's decoded text: always before version 5; from 5 on, not for BPE models
    (it says it ignores the flag there). Read without importing transformers."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major = int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return True
    if major < 5:
        return True
    try:
        model = json.loads(tokenizer_json.read_text()).get("model", {})
    except (OSError, ValueError):
        return True
    return model.get("type") != "BPE"


def _token_text(value: Any) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def _compile(chat_template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, **kw: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

    def strftime_now(fmt: str) -> str:
        return dt.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(chat_template)
