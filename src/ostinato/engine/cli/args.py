"""Argument parsing shared by ``ostinato`` and ``python -m benchmarks``: one-line errors and
option types that say what was wrong."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{self.prog}: error: {message}")


def fail(message: str) -> NoReturn:
    """Prints ``message`` as one line on stderr and exits with status 2."""
    print(" ".join(message.split()), file=sys.stderr)
    sys.exit(2)


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    return parse


def int_list(text: str) -> list[int]:
    """Comma- or space-separated integers, e.g. ``1,8,32``."""
    try:
        values = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of integers like '1,8,32'"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("empty; give integers like '1,8,32'")
    return values


def bounded_float(low: float, high: float, low_open: bool) -> Callable[[str], float]:
    """A finite float in ``[low, high]``, or ``(low, high]`` when ``low_open``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        below = value <= low if low_open else value < low
        if not math.isfinite(value) or below or value > high:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"must be in {bracket}{low}, {high}], got {text}")
        return value

    return parse
