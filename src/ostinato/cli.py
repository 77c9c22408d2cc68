"""The ``ostinato`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ostinato", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="capture a tiny model's ladder and check replay against eager")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ostinato.demo import main as demo_main

        return demo_main()
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
