"""The command line: every argparse parser of the project (see main.py)."""
from specdecode.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
