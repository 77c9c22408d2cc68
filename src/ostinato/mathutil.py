"""Small numeric helpers and argument checks shared by every layer."""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Iterable


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``."""
    return -(-a // b)


def is_int(x: object) -> bool:
    """True for Python and NumPy integers, False for bools (which are ints to Python)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def checked_int(name: str, value: object, least: int = 1) -> int:
    """``value`` as an int if it is an integer of at least ``least``; else an error
    naming the option ``name``: ``TypeError`` for what is no integer (a bool, a float, a
    string), ``ValueError`` for an integer below ``least``."""
    wanted = "a positive int" if least == 1 else f"an int >= {least}"
    if not is_int(value):
        raise TypeError(f"{name}: expected {wanted}, got {value!r}")
    if int(value) < least:  # type: ignore[call-overload]
        raise ValueError(f"{name}: expected {wanted}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def checked_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool; else ``TypeError`` naming the option ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return value


def repeated(values: Iterable[int]) -> list[int]:
    """The values that occur more than once, sorted (a list of sizes refuses them)."""
    return sorted(v for v, n in Counter(values).items() if n > 1)
