"""GGUF checkpoints (llama.cpp's format) through the ``gguf`` package.

``GGUFCheckpoint`` reads the architecture and hyperparameters from the file's metadata,
dequantizes every tensor to float32 (any type ``gguf.quants`` implements: Q4_0, Q4_1,
Q8_0, F16, BF16, F32, the K-quants, ...), maps llama.cpp's tensor names to Hugging Face
names, undoes the row permutation llama.cpp's converter applies to the q and k
projections, and hands the result to ``weights.assign_tensors``. The tokenizer and chat
template come from the same file through transformers, which reads the reader this
class already built (the file's metadata is parsed once per load, not three times).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ostinato.engine.loading.weights import WeightsError, assign_tensors
from ostinato.engine.model.config import ModelConfig, ModelConfigError
from ostinato.engine.model.decoder import DecoderModel

_SUPPORTED_ARCHS = ("llama",)
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation: per head it stored rows as interleaved
    (even, odd) pairs; Hugging Face's rotate-half layout keeps the two halves apart."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k permutation (the converter's direction); for tests."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One ``.gguf`` file: its ``config``, its weights, its tokenizer and EOS token."""

    def __init__(self, path: str | Path) -> None:
        try:
            import gguf
        except ImportError:
            raise WeightsError(
                f"{path}: reading GGUF files needs the gguf package (pip install gguf)"
            ) from None
        self.path = Path(path)
        try:
            self.reader = plain_reader(gguf, self.path)
        except Exception as exc:  # a truncated or foreign file
            raise WeightsError(f"{self.path}: not a readable GGUF file ({exc})") from None
        self.arch = self._field("general.architecture")
        if self.arch not in _SUPPORTED_ARCHS:
            raise ModelConfigError(
                f"{self.path}: GGUF architecture {self.arch!r} not supported; the engine "
                f"loads {', '.join(_SUPPORTED_ARCHS)} GGUF files"
            )
        self.config = self._config()

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is None:
                raise ModelConfigError(f"{self.path}: GGUF metadata lacks {key!r}")
            return default
        return field.contents()

    def _config(self) -> ModelConfig:
        a = self.arch
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise ModelConfigError(
                f"{self.path}: per-frequency RoPE factors (rope_freqs, Llama 3.1 scaling) in "
                "GGUF files are not supported; use the safetensors checkpoint"
            )
        scaling = self._field(f"{a}.rope.scaling.type", "none")
        if scaling not in ("none", ""):
            raise ModelConfigError(f"{self.path}: RoPE scaling {scaling!r} not supported")
        hidden = int(self._field(f"{a}.embedding_length"))
        heads = int(self._field(f"{a}.attention.head_count"))
        head_dim = int(self._field(f"{a}.rope.dimension_count", hidden // heads))
        if head_dim != int(self._field(f"{a}.attention.key_length", head_dim)):
            raise ModelConfigError(f"{self.path}: partial rotary dimensions are not supported")
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._field(f"{a}.vocab_size", len(tokens.data) if tokens is not None else None)
        return ModelConfig(
            architecture="LlamaForCausalLM",
            hidden_size=hidden,
            intermediate_size=int(self._field(f"{a}.feed_forward_length")),
            num_layers=int(self._field(f"{a}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self._field(f"{a}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            vocab_size=int(vocab),
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(self._field(f"{a}.context_length")),
            tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            o_bias="blk.0.attn_output.bias" in names,
            qk_norm=False,
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence token, from the file's tokenizer metadata."""
        eos = self.reader.fields.get("tokenizer.ggml.eos_token_id")
        return (int(eos.contents()),) if eos is not None else ()

    def load_into(self, model: DecoderModel) -> None:
        """Dequantizes every tensor into ``model``; ``WeightsError`` names a bad one."""
        assign_tensors(model, self.tensors(), str(self.path))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, dequantized to float32, under its Hugging Face name."""
        from gguf.quants import dequantize

        cfg = self.config
        for t in self.reader.tensors:
            name = _hf_name(t.name)
            try:
                data = dequantize(t.data, t.tensor_type)  # (a plain view: ``plain_reader``)
            except NotImplementedError:
                raise WeightsError(
                    f"{self.path}: tensor {t.name} has type {t.tensor_type.name}, which the "
                    "installed gguf package cannot dequantize; upgrade gguf or use another "
                    "quantization"
                ) from None
            tensor = torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy
            if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
                tensor = unpermute_rope_rows(tensor, cfg.num_heads)
            elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
                tensor = unpermute_rope_rows(tensor, cfg.num_kv_heads)
            yield name, tensor

    def tokenizer(self) -> Any:
        """A transformers tokenizer built from the file (with its chat template), of the
        class ``AutoTokenizer`` picks for it (``_tokenizer_class``), or None when
        transformers is not installed."""
        try:
            import transformers
        except ImportError:
            return None
        chosen = _tokenizer_class(transformers, self.path.parent)
        with self._reader_reused():
            return chosen.from_pretrained(
                str(self.path.parent), gguf_file=self.path.name, local_files_only=True
            )

    @contextlib.contextmanager
    def _reader_reused(self) -> Iterator[None]:
        """Inside, ``gguf.GGUFReader`` of this file returns the reader already built.

        transformers builds the tokenizer's config and vocabulary from two readers of its
        own (``load_gguf_checkpoint`` imports ``GGUFReader`` from ``gguf`` on each call);
        parsing the 442k metadata parts of SmolLM2's file costs seconds each time. The
        reader is read-only (a memory map), so sharing it changes nothing else.
        """
        import gguf

        original = gguf.GGUFReader
        mine = self.reader
        path = str(self.path.resolve())

        def reader(file: Any, *args: Any, **kwargs: Any) -> Any:
            if not args and not kwargs and str(Path(file).resolve()) == path:
                return mine
            return original(file, *args, **kwargs)

        gguf.GGUFReader = reader
        try:
            yield
        finally:
            gguf.GGUFReader = original


def _tokenizer_class(transformers: Any, folder: Path) -> Any:
    """The class ``AutoTokenizer`` builds a llama GGUF's tokenizer with. On transformers
    5 it follows from the file's config (model type llama) and the folder's tokenizer
    files: with none beside the file, the generic ``TokenizersBackend``, called here
    directly. ``AutoTokenizer`` would first import transformers' model and generation
    code, which the tokenizer does not depend on: an H200 host's first tokenizer took
    14 s that way, 5.8 s of it in those imports. The tests check that both save the same
    files. Elsewhere (transformers 4, tokenizer files beside it): ``AutoTokenizer``."""
    direct = getattr(transformers, "TokenizersBackend", None)
    beside = any((folder / n).is_file() for n in ("tokenizer_config.json", "tokenizer.json"))
    return direct if direct is not None and not beside else transformers.AutoTokenizer


def plain_reader(gguf: Any, path: Path) -> Any:
    """``gguf.GGUFReader`` of ``path`` over a plain array view of its memory map: the same
    bytes, read the same way. The reader slices its map once per metadata part (some
    250k for SmolLM2's vocabulary and merges), and each slice of a ``np.memmap`` pays the
    subclass's bookkeeping: 2.6-2.9 s against 1.1 s on a CPU of the test machine."""

    class PlainReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:  # (the reader's own np.memmap)
            self._plain = np.asarray(mapped)

    return PlainReader(str(path))


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK_NAME.match(gguf_name)
    if m and m.group(2) in _BLOCK:
        layer, module, kind = m.groups()
        return f"model.layers.{layer}.{_BLOCK[module]}.{kind}"
    return gguf_name  # unknown: assign_tensors names it
