"""Dispatcher: the runtime mode and padded batch descriptor for one step, in O(1)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ostinato.batch import BatchDescriptor
from ostinato.config import GraphConfig
from ostinato.mathutil import is_int
from ostinato.modes import GraphMode


@dataclass(frozen=True, slots=True)
class Dispatch:
    """What one step runs as: a runtime mode and the descriptor of its (padded) batch.

    For NONE the descriptor carries the real, unpadded token count.
    """

    mode: GraphMode
    descriptor: BatchDescriptor

    @property
    def padded_tokens(self) -> int:
        """Rows the step runs: the captured size, or the real count for NONE."""
        return self.descriptor.num_tokens


class Dispatcher:
    """Maps (num_tokens, uniform_decode, has_lora) to a ``Dispatch`` by table lookup.

    Guarantees: ``dispatch`` does no arithmetic proportional to the number of sizes and
    allocates no new objects for batches up to the largest capture size (every answer is
    precomputed at construction); for batches above the largest capture size it returns
    NONE with the real token count, never an error. ``keys(mode)`` is exactly
    the set of descriptors that can ever be returned with that mode, i.e. what to capture.

    ``mode`` (default: the config's) must already be resolved against the attention backend
    and platform; ``build_graph_runtime`` does that and is the one caller that passes it.
    ``uniform_decode_query_len`` is the query length of every
    request in a uniform decode step (1, or 1 + speculative tokens). ``max_num_reqs``
    bounds the uniform decode graphs. ``lora_enabled`` says whether the model may run
    LoRA at all; with ``config.specialize_lora`` graphs are captured with and without it.
    """

    def __init__(
        self,
        config: GraphConfig,
        mode: GraphMode | None = None,
        *,
        uniform_decode_query_len: int = 1,
        max_num_reqs: int | None = None,
        lora_enabled: bool = False,
    ) -> None:
        if uniform_decode_query_len < 1:
            raise ValueError(
                f"uniform_decode_query_len: must be >= 1, got {uniform_decode_query_len}"
            )
        resolved = config.mode if mode is None else GraphMode.parse(mode)
        if resolved is None:
            raise ValueError(
                "mode: the config says 'auto'; resolve it first (build_graph_runtime does)"
            )
        self.mode = resolved
        self.config = config
        self.max_num_reqs = max_num_reqs
        self.sizes = config.sizes
        self.max_size = config.largest_size
        self.uniform_decode_query_len = uniform_decode_query_len
        self.lora_enabled = lora_enabled
        self._lora_cases = (
            (False, True) if (lora_enabled and config.specialize_lora) else (lora_enabled,)
        )
        q = uniform_decode_query_len
        decode_limit = self.max_size if max_num_reqs is None else max_num_reqs * q
        uniform_full = self.mode.separate_routine() and self.mode.decode_mode() is GraphMode.FULL

        # pad_to[n] = smallest captured size >= n, for 1 <= n <= max_size.
        pad_to = _padding_table(self.sizes, self.max_size)
        # Uniform decode graphs hold q tokens per request, so their sizes are q times a
        # request count of the ladder (q = 1: the ladder itself); upad[n] = 0: no graph.
        limit = min(decode_limit, self.max_size)
        uniform_sizes = sorted({q * r for r in self.sizes if q * r <= limit})
        upad = _padding_table(uniform_sizes, self.max_size) if uniform_full else []

        self._keys: dict[GraphMode, set[BatchDescriptor]] = {
            GraphMode.FULL: set(),
            GraphMode.PIECEWISE: set(),
        }
        # _table[(uniform, lora)][n] -> Dispatch, n in 0..max_size.
        self._table: dict[tuple[bool, bool], list[Dispatch]] = {
            (uniform, lora): self._row(uniform, lora, pad_to, upad if uniform_full else None, q)
            for lora in self._lora_cases
            for uniform in (False, True)
        }

    def _row(
        self, uniform: bool, lora: bool, pad_to: list[int], upad: list[int] | None, q: int
    ) -> list[Dispatch]:
        """The dispatches of 0..max_size tokens for one (uniform, lora) case (``upad``:
        the uniform decode padding, None without uniform decode graphs); each descriptor
        that runs in a graph mode is added to ``_keys``."""
        mixed = self.mode.mixed_mode()
        row: list[Dispatch] = [Dispatch(GraphMode.NONE, BatchDescriptor(0, None))]
        for n in range(1, self.max_size + 1):
            if uniform and upad is not None and upad[n]:
                u = upad[n]
                d = Dispatch(GraphMode.FULL, BatchDescriptor(u, u // q, True, lora))
            elif mixed is not GraphMode.NONE:
                d = Dispatch(mixed, BatchDescriptor(pad_to[n], None, False, lora))
            else:
                d = Dispatch(GraphMode.NONE, BatchDescriptor(n, None, uniform, lora))
            if d.mode is not GraphMode.NONE:
                self._keys[d.mode].add(d.descriptor)
            row.append(d)
        return row

    def with_sizes(self, sizes: tuple[int, ...]) -> Dispatcher:
        """The same dispatcher over another ladder (validated as ``capture_sizes``)."""
        return Dispatcher(
            replace(self.config, capture_sizes=tuple(sizes), max_capture_size=None),
            self.mode,
            uniform_decode_query_len=self.uniform_decode_query_len,
            max_num_reqs=self.max_num_reqs,
            lora_enabled=self.lora_enabled,
        )

    def dispatch(
        self, num_tokens: int, uniform_decode: bool = False, has_lora: bool = False
    ) -> Dispatch:
        """The mode and padded descriptor for a step of ``num_tokens`` tokens.

        Batches larger than the largest capture size run NONE (eagerly) at their real
        size. Raises ``ValueError`` for a negative token count, and for ``has_lora``
        when the dispatcher was built without LoRA.
        """
        if has_lora and not self.lora_enabled:
            raise ValueError(
                "has_lora=True but the dispatcher was built with lora_enabled=False; "
                "build it with lora_enabled=True so graphs are captured with LoRA active"
            )
        try:
            if num_tokens < 0:
                raise ValueError(f"num_tokens: must be >= 0, got {num_tokens}")
            if num_tokens > self.max_size:
                return Dispatch(
                    GraphMode.NONE, BatchDescriptor(num_tokens, None, uniform_decode, has_lora)
                )
            lora = has_lora if len(self._lora_cases) == 2 else self._lora_cases[0]
            return self._table[(uniform_decode, lora)][num_tokens]
        except (TypeError, KeyError) as exc:  # checked only when the lookup fails
            raise _bad_arguments(num_tokens, uniform_decode, has_lora) from exc

    def keys(self, mode: GraphMode) -> list[BatchDescriptor]:
        """Descriptors dispatched with runtime ``mode`` (FULL or PIECEWISE), largest first.

        Mixed (non-uniform) descriptors come before uniform-decode ones of equal size.
        """
        if mode not in self._keys:
            raise ValueError(f"mode: keys exist only for FULL and PIECEWISE, got {mode.name}")
        return sorted(self._keys[mode], key=lambda d: (-d.num_tokens, d.uniform_decode, d.has_lora))


def _bad_arguments(num_tokens: object, uniform_decode: object, has_lora: object) -> TypeError:
    """The named error for arguments of the wrong type (``dispatch`` checks types only
    after its table lookup failed, so a correct call pays nothing for it)."""
    if not is_int(num_tokens):
        return TypeError(
            f"num_tokens: expected an int (the step's real token count), got "
            f"{num_tokens!r} ({type(num_tokens).__name__})"
        )
    for name, value in (("uniform_decode", uniform_decode), ("has_lora", has_lora)):
        if not isinstance(value, bool):
            return TypeError(f"{name}: expected True or False, got {value!r}")
    return TypeError(f"dispatch({num_tokens!r}, {uniform_decode!r}, {has_lora!r}): bad arguments")


def _padding_table(sizes: list[int], max_size: int) -> list[int]:
    """``table[n]`` = the smallest of ``sizes`` (ascending) that is >= n, for 0 < n <=
    ``max_size``; 0 where none is."""
    table = [0] * (max_size + 1)
    j = 0
    for n in range(1, max_size + 1):
        while j < len(sizes) and sizes[j] < n:
            j += 1
        if j == len(sizes):
            break
        table[n] = sizes[j]
    return table
