"""Loading checkpoint tensors into ``DecoderModel``: Hugging Face folders (safetensors,
sharded or not, or ``pytorch_model.bin``) and the shared name mapping GGUF uses too.

Every loader ends in ``assign_tensors``, which guarantees: each model parameter is
written exactly once from the checkpoint or the load fails naming what is missing; a
checkpoint tensor with no place in the model fails the load (it would change the
function) unless it is known to be derived data (rotary caches, a tied LM head).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ostinato.distributed.groups import TensorParallel
from ostinato.engine.model.decoder import DecoderModel

# HF name suffix -> (our parameter suffix, shard index within a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# Derived data some checkpoints carry: recomputed by the model, safe to skip.
_DERIVED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class WeightsError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


def load_weights(model: DecoderModel, model_dir: str | Path) -> None:
    """Copies the checkpoint in ``model_dir`` into ``model``.

    Reads ``*.safetensors`` (the files an index names, when there is one), else
    ``pytorch_model*.bin`` with ``weights_only=True``. Raises ``WeightsError`` naming a
    missing or unreadable file, a missing parameter, a shape mismatch or an unknown tensor.
    """
    folder = Path(model_dir)
    files = checkpoint_files(folder)
    assign_tensors(model, _read_all(files), str(folder))


def checkpoint_files(folder: Path) -> list[Path]:
    """The checkpoint files of ``folder``, safetensors first; ``WeightsError`` if none."""
    for index_name in _INDEXES:
        index = folder / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise WeightsError(f"{index}: not a valid checkpoint index ({exc})") from None
            files = [folder / name for name in sorted(set(weight_map.values()))]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise WeightsError(f"{index} names files that are missing: {absent}")
            return files
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise WeightsError(
            f"model directory {folder}: no *.safetensors or pytorch_model*.bin files; "
            "add the weights, or ask for random weights explicitly (random_weights=True, "
            "--random-weights)"
        )
    return files


def _read_all(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        yield from _read_file(f)


def _read_file(f: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if f.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # safe_open has no __iter__
                    yield name, st.get_tensor(name)
        except WeightsError:
            raise
        except Exception as exc:  # safetensors raises several error types for bad files
            raise WeightsError(
                f"{f}: cannot be read as safetensors ({exc}); re-download it"
            ) from None
        return
    try:
        # No mmap: it refuses the legacy (non-zip) pickles older checkpoints use.
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # a corrupt or non-tensor pickle
        raise WeightsError(
            f"{f}: cannot be read with torch.load(weights_only=True) ({exc}); re-download it "
            "or convert it to safetensors"
        ) from None
    if not isinstance(state, dict):
        raise WeightsError(f"{f}: holds a {type(state).__name__}, not a state dict")
    yield from state.items()


def assign_tensors(
    model: DecoderModel, tensors: Iterable[tuple[str, torch.Tensor]], source: str
) -> None:
    """Writes HF-named ``tensors`` into ``model`` (see the module docstring). Under tensor
    parallelism (``model.tp``) each rank keeps only its shard of every full tensor."""
    params = dict(model.named_parameters())
    cfg, tp = model.config, model.tp
    q = cfg.num_heads // tp.size * cfg.head_dim
    kv = cfg.num_kv_heads // tp.size * cfg.head_dim
    fused_splits = {
        "self_attn.qkv_proj": [q, kv, kv],
        "mlp.gate_up_proj": [cfg.intermediate_size // tp.size] * 2,
    }
    loaded: set[str] = set()
    unknown: list[str] = []
    for name, tensor in tensors:
        target, shard = _target(name)
        tensor = _tp_shard(target, tensor, tp)
        if tensor is None:
            continue  # a row-parallel bias: rank 0 holds it, the all-reduce adds it once
        if target not in params:
            if not _DERIVED.search(name) and not (
                cfg.tie_word_embeddings and target == "lm_head.weight"
            ):
                unknown.append(name)
            continue
        dest = params[target].data
        if shard is not None:
            sizes = fused_splits[_layer_module(target)]
            dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
        if dest.shape != tensor.shape:
            raise WeightsError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)} but the model "
                f"expects {tuple(dest.shape)} (is the config from this checkpoint?)"
            )
        with torch.no_grad():
            dest.copy_(tensor)
        loaded.add(f"{target}#{shard}")
    if unknown:
        raise WeightsError(
            f"{source}: tensors {unknown[:5]} have no place in the model "
            f"({len(unknown)} in all); the checkpoint and its config disagree, or it holds "
            "layers the engine does not implement"
        )
    if cfg.tie_word_embeddings:
        loaded.add("lm_head.weight#None")
    missing = []
    for pname in params:
        module = _layer_module(pname)
        shards = range(len(fused_splits[module])) if module in fused_splits else [None]
        missing += [
            f"{pname}[{s}]" if s is not None else pname
            for s in shards
            if f"{pname}#{s}" not in loaded
        ]
    if missing:
        raise WeightsError(
            f"{source}: checkpoint lacks {missing[:8]}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )


def _tp_shard(target: str, tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor | None:
    """This rank's part of the full checkpoint ``tensor`` for parameter ``target``."""
    if tp.size == 1:
        return tensor
    module, kind = _layer_module(target), target.rsplit(".", 1)[-1]
    column_parallel = module in ("self_attn.qkv_proj", "mlp.gate_up_proj") or target in (
        "embed_tokens.weight",
        "lm_head.weight",
    )
    if column_parallel:  # output rows split: whole heads, intermediate rows, vocab rows
        return tensor.chunk(tp.size, dim=0)[tp.rank]
    if module in ("self_attn.o_proj", "mlp.down_proj"):  # row parallel: input columns split
        if kind == "weight":
            return tensor.chunk(tp.size, dim=1)[tp.rank]
        return tensor if tp.rank == 0 else None
    return tensor  # norms: replicated


def _target(hf_name: str) -> tuple[str, int | None]:
    m = _LAYER.match(hf_name)
    if m:
        layer, module, kind = m.groups()
        if module in _FUSED:
            ours, shard = _FUSED[module]
            return f"layers.{layer}.{ours}.{kind}", shard
        return f"layers.{layer}.{module}.{kind}", None
    if hf_name.startswith("model."):
        return hf_name[len("model.") :], None
    return hf_name, None


def _layer_module(param_name: str) -> str:
    """``layers.3.self_attn.qkv_proj.weight`` -> ``self_attn.qkv_proj``; else ''."""
    parts = param_name.split(".")
    return ".".join(parts[2:-1]) if parts[0] == "layers" else ""
