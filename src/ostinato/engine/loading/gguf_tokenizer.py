"""A GGUF file's tokenizer, as transformers builds it from the file's metadata: here, by
the ``tokenizers`` library, where the file's vocabulary is one whose build this module
reproduces; otherwise by transformers in a child process.

**Built here** (``TokenizerBuiltHere``): a byte-level BPE vocabulary
(``tokenizer.ggml.model`` "gpt2", SmolLM2's) that transformers splits as GPT-2 does
(``tokenizer.ggml.pre`` absent or one of ``GPT2_SPLIT``: its build keys other splits on
that name, differently from version to version) and that adds no BOS, no EOS and no prefix
space. It is what transformers' GGUF build makes of the same metadata: the vocabulary
(tokens outside the byte alphabet spelled in it), the merges, the control tokens as special
added tokens and the user-defined ones as plain added tokens, GPT-2's byte-level split and
decoder, the special tokens and the chat template in the config (the tests compare the two
on SmolLM2's file). It takes a fraction of a second; importing transformers alone takes
seconds (4 on a development machine, about 8 on the H200 host), and SmolLM2's first start
waited for that child.

**In a child process** (``TokenizerChild``), for every other file: transformers builds it
from the metadata (SmolLM2's: 442k parts) in seconds of Python. On a thread beside the
start, that work holds the GIL, and every torch call of the start that gives the GIL up then
waits up to a switch interval to take it back: on an H200, SmolLM2's first start spent 17.3 s
in its layer plan beside it, against 5.4 s with the tokenizer built before. The child holds
no lock of ours.

    python -m ostinato.engine.loading.gguf_tokenizer FILE.gguf OUT_FOLDER

Either writes the tokenizer's files into a folder of its own (``wait`` returns it), which
the parent reads back as a cache hit does (``tokenizer_file``, a fraction of a second).

Child exit status 0: the files are in OUT_FOLDER; ``NO_TRANSFORMERS``: transformers is not
installed, nothing written; anything else: failed, the error on stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

NO_TRANSFORMERS = 3
_TAIL = 2000  # characters of a failed child's stderr kept in the error


class TokenizerChildError(RuntimeError):
    """The child could not build the tokenizer (its message ends with the child's stderr)."""


class TokenizerChild:
    """The child building ``path``'s tokenizer into a folder of its own, started at once.
    ``wait`` returns that folder; ``close`` ends the child if it still runs and removes the
    folder (safe more than once)."""

    module = __name__  # what the child runs (``python -m``)

    def __init__(self, path: Path) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="ostinato-tokenizer-"))
        # A file, not a pipe: transformers' warnings never fill a buffer nobody reads.
        self._stderr = tempfile.TemporaryFile(mode="w+")
        # The parent's import path, so the child imports the same ostinato; no GPU.
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", self.module, str(path), str(self.folder)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            env=env,
        )

    def wait(self) -> Path | None:
        """Waits for the child: the folder holding the tokenizer's files, or None where
        transformers is not installed. Raises ``TokenizerChildError`` if it failed."""
        code = self._proc.wait()
        if code == 0:
            return self.folder
        if code == NO_TRANSFORMERS:
            return None
        self._stderr.seek(0)
        tail = self._stderr.read()[-_TAIL:].strip()
        raise TokenizerChildError(
            f"the child process building the GGUF tokenizer exited with status {code}: "
            f"{tail or '(no output)'}"
        )

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)


GPT2_SPLIT = frozenset({"default", "gpt2", "smollm"})  # ``tokenizer.ggml.pre`` names split as GPT-2
_CONTROL, _USER_DEFINED = 3, 4  # ``tokenizer.ggml.token_type`` values (llama.cpp's)
_SPECIAL = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
_ADDS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")


def _value(fields: Mapping[str, Any], key: str) -> Any:
    field = fields.get(key)
    return None if field is None else field.contents()


def builds_here(fields: Mapping[str, Any]) -> bool:
    """Whether the tokenizer that ``fields`` (a GGUF reader's metadata) describe is one this
    module builds itself (the module docstring); reads only a few scalar fields."""
    if _value(fields, "tokenizer.ggml.model") != "gpt2":
        return False
    pre = _value(fields, "tokenizer.ggml.pre")
    if pre is not None and pre not in GPT2_SPLIT:
        return False
    if any(_value(fields, key) for key in (*_ADDS, "tokenizer.ggml.add_space_prefix")):
        return False
    return "tokenizer.ggml.tokens" in fields and "tokenizer.ggml.merges" in fields


def byte_level_files(fields: Mapping[str, Any]) -> dict[str, str]:
    """The tokenizer's files (name: text) where ``builds_here(fields)``: ``tokenizer.json``,
    ``tokenizer_config.json`` (the special tokens) and ``chat_template.jinja`` where the
    file has a template. Raises ``ValueError`` naming a malformed vocabulary."""
    tokens = list(_value(fields, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ")) for m in _value(fields, "tokenizer.ggml.merges")]
    bad = next((" ".join(m) for m in merges if len(m) != 2), None)
    if bad is not None:
        raise ValueError(f"GGUF tokenizer: merge {bad!r} is not two tokens apart")
    kinds = list(_value(fields, "tokenizer.ggml.token_type") or ())
    config = {}
    for name, key in _SPECIAL.items():
        index = _value(fields, key)
        if index is not None:
            if not 0 <= int(index) < len(tokens):
                raise ValueError(f"GGUF tokenizer: {key} {index} is not a token id")
            config[name] = tokens[int(index)]
    files = {
        "tokenizer.json": _byte_level_bpe(tokens, merges, kinds).to_str(),
        "tokenizer_config.json": json.dumps(config, ensure_ascii=False),
    }
    template = _value(fields, "tokenizer.chat_template")
    if template:
        files["chat_template.jinja"] = template
    return files


def _byte_level_bpe(tokens: list[str], merges: list[tuple], kinds: list[int]) -> Any:
    """transformers' byte-level BPE of a GGUF vocabulary (``byte_level_files``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    bytewise = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def spelled(token: str) -> str:  # (each UTF-8 byte as the byte alphabet writes it)
        if set(token) <= alphabet:
            return token
        return "".join(piece for piece, _ in bytewise.pre_tokenize_str(token))

    vocab = {spelled(token): index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))  # fmt: skip
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    marked = list(zip(tokens, kinds, strict=False))  # (a file may have no token types)
    # A control token spelled outside the byte alphabet is a mislabel (transformers skips
    # it: added, it would grow the vocabulary past the model's).
    control = [t for t, kind in marked if kind == _CONTROL and set(t) <= alphabet]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in marked if kind == _USER_DEFINED and t in vocab]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tokenizer


class TokenizerBuiltHere:
    """The tokenizer ``byte_level_files`` makes of a GGUF file's ``fields``, written into a
    folder of its own at the first ``wait`` (on the caller's thread); ``close`` removes
    the folder (safe more than once). The same calls as ``TokenizerChild``'s."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self._fields = fields
        self.folder: Path | None = None

    def wait(self) -> Path:
        if self.folder is None:
            folder = Path(tempfile.mkdtemp(prefix="ostinato-tokenizer-"))
            for name, text in byte_level_files(self._fields).items():
                (folder / name).write_text(text, encoding="utf-8")
            self.folder = folder
        return self.folder

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def tokenizer_build(path: Path, fields: Mapping[str, Any]) -> TokenizerBuiltHere | TokenizerChild:
    """How the tokenizer of the GGUF file ``path`` (its reader's ``fields``) is made: here
    where ``builds_here``, else by a child started now."""
    return TokenizerBuiltHere(fields) if builds_here(fields) else TokenizerChild(path)


def main() -> None:
    """The child's entry (``argv``: the GGUF file, the folder): saves the file's tokenizer
    to the folder, or exits with ``NO_TRANSFORMERS`` where the file has none."""
    from ostinato.engine.loading.gguf_file import GGUFCheckpoint

    path, out = Path(sys.argv[1]), Path(sys.argv[2])
    tokenizer = GGUFCheckpoint(path).tokenizer()
    if tokenizer is None:
        sys.exit(NO_TRANSFORMERS)
    tokenizer.save_pretrained(str(out))


if __name__ == "__main__":
    main()
