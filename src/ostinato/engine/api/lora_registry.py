"""The engine's LoRA adapters by name: loaded from PEFT folders, checked against the model,
packed for the device slots, resolved for requests, unloaded.

Guarantees: a name resolves to the adapter loaded under it last; a request gets the
adapter object itself, so unloading or reloading a name never changes what a queued or
running request computes; an adapter in use by running requests is not unloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ostinato.engine.core.lora_slots import LoraAdapter, LoraSlots
from ostinato.engine.loading.peft_adapter import read_peft_adapter
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.lora import LoraWeights

LoraNames = str | None | Sequence[str | None]
"""A request's adapter: one name (or None, the base model) for every prompt, or one per
prompt."""


class UnknownAdapter(ValueError):
    """A request or call named an adapter that is not loaded (the server's 404)."""


class LoraNotEnabled(ValueError):
    """A LoRA call to an engine built without ``enable_lora``."""


class AdapterInUse(ValueError):
    """An adapter running requests use was asked to be unloaded (the server's 409)."""


class LoraRegistry:
    """Adapters by name for one engine (see the module docstring)."""

    def __init__(self, weights: LoraWeights, config: ModelConfig, slots: LoraSlots) -> None:
        self.weights, self.config, self.slots = weights, config, slots
        self.adapters: dict[str, LoraAdapter] = {}

    @property
    def names(self) -> list[str]:
        """The adapters' names, in the order they were loaded."""
        return list(self.adapters)

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Reads, checks and packs the PEFT adapter at ``path`` under ``name``
        (``LoraAdapterError`` names what does not fit); a name already loaded is
        refused (unload it first)."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"lora name: expected a non-empty string, got {name!r}")
        if name in self.adapters:
            raise ValueError(f"lora: an adapter named {name!r} is loaded; unload it first")
        peft = read_peft_adapter(name, path, self.config, self.weights.shape.max_rank)
        packed = self.weights.pack(peft.weights, peft.scaling)
        adapter = LoraAdapter(name, peft.rank, packed)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Forgets ``name`` (its slot becomes free); refused while running requests use
        it, and for a name not loaded."""
        adapter = self.get(name)
        try:
            self.slots.forget(adapter)
        except RuntimeError:
            raise AdapterInUse(
                f"unload_lora: {name!r} is in use by running requests; abort them or let "
                "them finish first"
            ) from None
        del self.adapters[name]

    def get(self, name: str) -> LoraAdapter:
        """The adapter loaded as ``name``; ``UnknownAdapter`` names the known ones."""
        if name not in self.adapters:
            known = ", ".join(self.adapters) or "none"
            raise UnknownAdapter(f"lora: no adapter named {name!r} (loaded: {known})")
        return self.adapters[name]

    def resolve(self, names: LoraNames, count: int) -> list[LoraAdapter | None]:
        """One adapter (or None) per prompt of ``count``; ``UnknownAdapter`` for a name
        not loaded, ``ValueError`` for a list of another length."""
        if names is None or isinstance(names, str):
            names = [names] * count
        names = list(names)
        if len(names) != count:
            raise ValueError(f"lora: expected one name per prompt ({count}), got {len(names)}")
        return [None if n is None else self.get(n) for n in names]


def resolve_without_lora(names: LoraNames, count: int) -> list[None]:
    """``resolve`` of an engine built without LoRA: only None is accepted."""
    if names is None or (not isinstance(names, str) and all(n is None for n in names)):
        return [None] * count
    raise ValueError(
        "lora: this engine was built without LoRA; build it with enable_lora=True "
        "(and max_loras, max_lora_rank)"
    )
