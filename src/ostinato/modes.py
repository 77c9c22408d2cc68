"""Graph modes: which parts of a forward pass run as captured graphs.

A mode is either a single runtime mode (NONE, PIECEWISE, FULL) or a pair
``(decode_mode, mixed_mode)`` that uses a separate routine for uniform decode
batches (FULL_DECODE_ONLY, FULL_AND_PIECEWISE). Only the three single modes are
ever *runtime* modes, i.e. what one step actually runs in.
"""

from __future__ import annotations

import enum


class GraphMode(enum.Enum):
    """How a model's steps are run: eagerly, as piecewise graphs, or as one full graph.

    Guarantees: ``decode_mode()`` and ``mixed_mode()`` always return one of the three
    runtime modes (NONE, PIECEWISE, FULL); ``parse`` accepts any member name in any case
    and raises ``ValueError`` listing the valid names otherwise.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    @classmethod
    def parse(cls, value: GraphMode | str) -> GraphMode:
        """Returns the mode named by ``value`` (a member or its name, any case)."""
        if isinstance(value, GraphMode):
            return value
        if isinstance(value, str):
            key = value.strip().upper().replace("-", "_")
            if key in cls.__members__:
                return cls.__members__[key]
        names = ", ".join(cls.__members__)
        raise ValueError(f"mode: unknown graph mode {value!r}; use one of {names}")

    def separate_routine(self) -> bool:
        """True when uniform decode batches and mixed batches use different modes."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> GraphMode:
        """The runtime mode for uniform decode batches."""
        return GraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> GraphMode:
        """The runtime mode for mixed prefill/decode batches."""
        return GraphMode(self.value[1]) if self.separate_routine() else self

    def has_full_graphs(self) -> bool:
        """True when some batches replay one graph for the whole forward pass."""
        return GraphMode.FULL in (self.decode_mode(), self.mixed_mode())

    def has_piecewise_graphs(self) -> bool:
        """True when some batches run piecewise graphs (needs the compile backend)."""
        return GraphMode.PIECEWISE in (self.decode_mode(), self.mixed_mode())

    def is_runtime_mode(self) -> bool:
        """True for NONE, PIECEWISE and FULL: the modes one step can run in."""
        return not self.separate_routine()
