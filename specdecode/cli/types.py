"""argparse pieces shared by every subcommand: bounded number types and a parser whose errors are one line.

A bad flag is refused while the command line is parsed, before anything is imported or loaded, with a message
that names the flag as the user typed it (argparse adds "argument --flag:" in front of what a type raises).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from specdecode.speculation.config import MAX_SPECULATIVE_TOKENS


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (not the whole usage block) and exit with status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _describe(lo, hi) -> str:
    if hi is None:
        return f">= {lo}"
    if lo is None:
        return f"<= {hi}"
    return f"between {lo} and {hi}"


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers, e.g. 1,2,4."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def int_range(lo: int | None = None, hi: int | None = None):
    """An argparse type: an integer in [lo, hi] (either end may be None: unbounded)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {_describe(lo, hi)}, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be an integer {_describe(lo, hi)}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def float_range(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False):
    """An argparse type: a finite number in the interval from lo to hi ((lo or [lo, hi] or hi) as the flags say)."""
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    if lo is not None and hi is not None:
        bounds = f"in {left}{lo:g}, {hi:g}{right}"
    elif lo is not None:
        bounds = f"{'>' if lo_open else '>='} {lo:g}"
    elif hi is not None:
        bounds = f"{'<' if hi_open else '<='} {hi:g}"
    else:
        bounds = "finite"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {bounds}, got {text!r}") from None
        bad = not math.isfinite(value)
        if lo is not None:
            bad |= value <= lo if lo_open else value < lo
        if hi is not None:
            bad |= value >= hi if hi_open else value > hi
        if bad:
            raise argparse.ArgumentTypeError(f"must be a number {bounds}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def existing_path(text: str) -> Path:
    """An argparse type: a file or directory that exists."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return path


POSITIVE = int_range(1)
PORT = int_range(0, 65535)
SPECULATIVE_TOKENS = int_range(1, MAX_SPECULATIVE_TOKENS)
"""--num-speculative-tokens: K draft levels per step."""
THREADS = int_range(1, 1024)
MAX_NUM_SEQS = int_range(1, 4096)
TOKENS = int_range(1, 1_000_000)
PROBABILITY = float_range(0.0, 1.0, lo_open=True)
TEMPERATURE = float_range(0.0, 100.0)
SECONDS = float_range(0.0, None, lo_open=True)
GIB = float_range(0.0, None, lo_open=True)
SEED = int_range(0, 2**63 - 1)
