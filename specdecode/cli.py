"""`specdecode` command line: each layer registers its own subcommands."""
from __future__ import annotations

import argparse
import sys

from specdecode.argtypes import OneLineParser
from specdecode.errors import SpecdecodeError


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="specdecode", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from specdecode import commands

    for register in commands.REGISTRY:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed in one line
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.func(args) or 0
    except SpecdecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
