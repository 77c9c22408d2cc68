"""Argument parsing shared by ``ostinato`` and ``python -m benchmarks``: one-line errors and
option types that say what was wrong."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

# The engine's option types (its flags are derived from ``EngineArgs``), for the other
# flags of ``ostinato`` and ``python -m benchmarks`` too.
from ostinato.engine.api.engine_args import bounded_float, bounded_int, positive_int

__all__ = [
    "DefaultsHelp",
    "OneLineParser",
    "bounded_float",
    "bounded_int",
    "fail",
    "int_list",
    "positive_int",
]


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{self.prog}: error: {message}")


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends with each option's default, except where the help already says
    what the default is (no "default: X (default: None)", and no secret read from the
    environment, ``--api-key``'s, printed by ``--help``) and where there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def fail(message: str) -> NoReturn:
    """Prints ``message`` as one line on stderr and exits with status 2."""
    print(" ".join(message.split()), file=sys.stderr)
    sys.exit(2)


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
