"""Which LoRA adapter each device slot holds, and who uses it.

The device holds ``capacity`` adapters at once (``model.lora.LoraWeights``). A request
that names an adapter is admitted only with a slot holding it: the one already holding
it, else a slot no running request uses, emptiest first, then least recently used; the
adapter it held is evicted and the new one's weights are written into the slot before
the step that admitted the request runs (``take_loads``). When every slot is in use by
running requests, the request waits.

Guarantees: a slot is used only by requests holding it (``acquire`` to ``release``);
its adapter changes only while none does; a slot named resident holds that adapter's
weights by the time a step reads it (its load is taken with the step that needs it);
after ``reset`` nothing is held and nothing is taken for resident that a failed step
may not have written.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """An adapter the engine registered: its name, rank, and its weights in the slots'
    layout (opaque here: ``LoraWeights.pack``'s value). Identity, not value: the same
    name loaded again is another adapter."""

    name: str
    rank: int
    packed: Any = field(repr=False)


@dataclass(frozen=True)
class LoraLoad:
    """Write ``adapter`` into device slot ``slot`` before the step runs."""

    slot: int
    adapter: LoraAdapter


class LoraSlots:
    """The host's record of the device slots (see the module docstring). Thread-safe:
    the engine's thread acquires and releases while another unloads an adapter."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"max_loras: expected >= 1, got {capacity}")
        self.capacity = capacity
        self.held: list[LoraAdapter | None] = [None] * capacity  # what each slot holds
        self.users = [0] * capacity  # running requests per slot
        self.last_use = [0] * capacity
        self._clock = 0
        self._loads: list[LoraLoad] = []
        self._lock = threading.Lock()

    def slot_of(self, adapter: LoraAdapter) -> int | None:
        """The slot holding ``adapter``, or None."""
        return next((i for i, held in enumerate(self.held) if held is adapter), None)

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """A slot holding ``adapter`` for one more request (loading it into a free slot
        where none holds it: a ``LoraLoad`` to take), or None when every slot is used."""
        with self._lock:
            return self._acquire(adapter)

    def _acquire(self, adapter: LoraAdapter) -> int | None:
        slot = self.slot_of(adapter)
        if slot is None:
            free = [i for i in range(self.capacity) if self.users[i] == 0]
            if not free:
                return None
            slot = min(free, key=lambda i: (self.held[i] is not None, self.last_use[i]))
            self.held[slot] = adapter
            self._loads = [load for load in self._loads if load.slot != slot]
            self._loads.append(LoraLoad(slot, adapter))
        self.users[slot] += 1
        self._clock += 1
        self.last_use[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        """One request stopped using ``slot``."""
        with self._lock:
            if self.users[slot] < 1:
                raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
            self.users[slot] -= 1

    def take_loads(self) -> list[LoraLoad]:
        """The loads since the last call, for the step about to run."""
        with self._lock:
            loads, self._loads = self._loads, []
        return loads

    def forget(self, adapter: LoraAdapter) -> None:
        """Drops ``adapter`` from its slot (unloaded); refused while a request uses it."""
        with self._lock:
            slot = self.slot_of(adapter)
            if slot is None:
                return
            if self.users[slot]:
                raise RuntimeError(f"LoRA adapter {adapter.name!r} is in use by running requests")
            self.held[slot] = None
            self._loads = [load for load in self._loads if load.slot != slot]

    def reset(self) -> None:
        """Nothing used, nothing resident: after a failed or interrupted call, a load
        taken may not have been written, so every adapter is loaded again when next
        used."""
        with self._lock:
            self.held = [None] * self.capacity
            self.users = [0] * self.capacity
            self._loads = []
