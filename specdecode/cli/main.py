"""`specdecode` command line: the parser of every subcommand, built from the modules of this package.

Every argparse parser of the project lives in specdecode/cli/; a command module has `register(sub)` (its flags)
and a `cmd_*(args)` function that checks them and calls the layers below. Command modules are imported when the
parser is built, so they import nothing heavy (torch, the model) at the top.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from specdecode.cli.types import OneLineParser
from specdecode.errors import SpecdecodeError

COMMANDS = ("generate", "chat", "serve", "models", "train", "bench", "datastore", "plan", "certify")
"""The modules of specdecode.cli that register subcommands, in the order `specdecode --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="specdecode", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"specdecode.cli.{name}").register(sub)
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
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (what it stopped says what it kept)
        print("\nspecdecode: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
