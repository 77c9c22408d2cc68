"""Small numeric helpers shared by every layer."""

from __future__ import annotations

import numbers


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``."""
    return -(-a // b)


def is_int(x: object) -> bool:
    """True for Python and NumPy integers, False for bools (which are ints to Python)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
