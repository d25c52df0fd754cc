"""Seconds from starting a command to its first byte of output (with `generate --chat`: the first token) and to its
exit, over several runs (start-up figures).

    python benchmarks/first_token.py --runs 3 -- specdecode generate "What is the capital of France?" --chat --threads 1
"""
from __future__ import annotations

import argparse
import subprocess
import time


def first_token(command: list[str]) -> tuple[float, float]:
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    process.stdout.read(1)
    first = time.perf_counter() - start
    process.stdout.read()
    process.wait()
    return first, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    for _ in range(args.runs):
        first, done = first_token(command)
        print(f"first output {first:.2f} s, exit {done:.2f} s")


if __name__ == "__main__":
    main()
