"""Reading a LoRA adapter from a PEFT folder (``adapter_config.json`` and
``adapter_model.safetensors``), checked against the model it is to run on.

Guarantees: what is returned computes PEFT's ``y = x W^T + scaling * (x A^T) B^T`` for
each adapted projection (``scaling`` = alpha / r, or alpha / sqrt(r) with rsLoRA);
anything that would compute something else (DoRA, biases, patterns of ranks, other
modules, shapes that do not fit) is refused with a ``LoraAdapterError`` naming it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.lora import MODULES, projection_shapes

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoraAdapterError(ValueError):
    """An adapter the engine cannot run; the message names the adapter, what and why."""


@dataclass(frozen=True)
class PeftWeights:
    """An adapter's rank, scaling and ``(layer, module) -> (A [r, in], B [out, r])``."""

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_peft_adapter(
    name: str, path: str | Path, config: ModelConfig, max_rank: int
) -> PeftWeights:
    """The adapter in PEFT folder ``path`` for a model of ``config``, refused
    (``LoraAdapterError``) where its rank exceeds ``max_rank``, a target module is not
    one of the q, k, v, o, gate, up and down projections, or a shape does not fit."""
    folder = Path(path)
    settings = _settings(name, folder)
    rank = settings.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraAdapterError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraAdapterError(
            f"LoRA adapter {name!r}: rank {rank} exceeds max_lora_rank={max_rank}; "
            f"start the engine with max_lora_rank >= {rank}"
        )
    alpha = settings.get("lora_alpha", rank)
    rslora = bool(settings.get("use_rslora", False))
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    weights = _weights(name, folder, config, rank)
    return PeftWeights(rank, float(scaling), weights)


def _settings(name: str, folder: Path) -> dict[str, Any]:
    """``adapter_config.json``, refused where it asks for what the engine does not do."""
    file = folder / "adapter_config.json"
    if not file.is_file():
        raise LoraAdapterError(
            f"LoRA adapter {name!r}: {file} not found; give a PEFT adapter folder "
            "(adapter_config.json and adapter_model.safetensors)"
        )
    try:
        settings = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {file} is not JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise LoraAdapterError(f"LoRA adapter {name!r}: {file} holds no settings object")
    if settings.get("peft_type", "LORA") != "LORA":
        kind = settings["peft_type"]
        raise LoraAdapterError(f"LoRA adapter {name!r}: peft_type {kind!r}, not LORA")
    unsupported = {
        "use_dora": "DoRA",
        "fan_in_fan_out": "fan_in_fan_out weights",
        "modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
        "rank_pattern": "a rank per module (rank_pattern)",
        "alpha_pattern": "an alpha per module (alpha_pattern)",
    }
    for key, what in unsupported.items():
        if settings.get(key):
            raise LoraAdapterError(f"LoRA adapter {name!r}: {what} is not supported")
    if settings.get("bias", "none") != "none":
        raise LoraAdapterError(f"LoRA adapter {name!r}: bias={settings['bias']!r}; only 'none'")
    targets = settings.get("target_modules")
    if isinstance(targets, list):
        _check_modules(name, targets)
    return settings


def _check_modules(name: str, modules: list[str]) -> None:
    bad = sorted({m.rsplit(".", 1)[-1] for m in modules} - set(MODULES))
    if bad:
        raise LoraAdapterError(
            f"LoRA adapter {name!r}: target modules {bad} are not supported; the engine "
            f"adapts {', '.join(MODULES)}"
        )


def _weights(
    name: str, folder: Path, config: ModelConfig, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Each adapted projection's (A, B), every shape checked."""
    from safetensors.torch import load_file

    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise LoraAdapterError(f"LoRA adapter {name!r}: {file} not found")
    try:
        tensors = load_file(str(file))
    except Exception as exc:  # (safetensors' own error type: a truncated or foreign file)
        why = f"LoRA adapter {name!r}: {file} is not safetensors ({exc})"
        raise LoraAdapterError(why) from None
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not supported")
        layer, module, side = int(match[1]), match[2], match[3]
        _check_modules(name, [module])
        if layer >= config.num_layers:
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: {key!r} adapts layer {layer}; the model has "
                f"{config.num_layers}"
            )
        found.setdefault((layer, module), {})[side] = tensor
    shapes = projection_shapes(config)
    weights = {}
    for (layer, module), sides in found.items():
        if set(sides) != {"A", "B"}:
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B"
            )
        a, b = sides["A"], sides["B"]
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and "
                f"B {tuple(b.shape)}; this model needs A ({rank}, {fan_in}) and B "
                f"({fan_out}, {rank}): the adapter was trained for another model"
            )
        weights[(layer, module)] = (a.float(), b.float())
    if not weights:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {file} holds no LoRA weights")
    return weights
