# Record: how docs/bench/adaptive_sweep.json was made, on the 23M/2.6M standard-library pair that specdecode/catalog/ held until 2026-12-04: python docs/bench/adaptive_sweep.py --target TARGET --draft DRAFT --threads 1 --max-tokens 128 --repeats 6
"""Adaptive speculation vs plain decoding vs fixed K at batch sizes 1..32, on a target/draft pair.

    python docs/bench/adaptive_sweep.py --target T --draft D                 # full sweep, Markdown table on stdout
    python docs/bench/adaptive_sweep.py --target T --draft D --quick         # fewer tokens and repeats
    python docs/bench/adaptive_sweep.py --target T --draft D --json out.json # also save the rows
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdecode.bench.sweep import adaptive_sweep, markdown_table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--ks", default="1,2,3,4,5", help="fixed draft lengths to compare (the largest is adaptive's cap)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workload", default="completion", help="bench workload the prompts come from")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="--max-tokens 32 --repeats 1")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default=None)
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args()
    if args.quick:
        args.max_tokens, args.repeats = 32, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = adaptive_sweep(args.target, args.draft, batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
                          ks=[int(k) for k in args.ks.split(",")], max_tokens=args.max_tokens, repeats=args.repeats,
                          workload=args.workload, device=args.device)
    print(markdown_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
