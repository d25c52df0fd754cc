# Record: how docs/bench/speed.md, speed.json and speed.png were made (today: specdecode bench --speed): python docs/bench/speed.py --model /path/to/SmolLM2 --clock cpu
"""Speed of plain decoding and verification per dtype and linear backend, against transformers and the memory
roofline; cost of a pass over K tokens for K = 1..16; batch-8 throughput. Writes speed.md, speed.json and
speed.png (default: docs/bench/). The same as `specdecode bench --speed`.

    python docs/bench/speed.py --model /path/to/SmolLM2-135M-Instruct [--tokens 128] [--rounds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specdecode.bench.speed import SpeedConfig, run_speed
from specdecode.bench.speed_report import write_speed_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory or GGUF file")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per run (default 128)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    parser.add_argument("--backends", default="onednn,plain,int8",
                        help="comma-separated; int8 = weight-only int8 (default onednn,plain,int8)")
    parser.add_argument("--max-verify", type=int, default=16, help="passes over K = 1..this tokens (default 16)")
    parser.add_argument("--batch", type=int, default=8, help="batch size compared with batch 1 (default 8)")
    parser.add_argument("--no-peers", action="store_true", help="skip transformers")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                        help="wall (default) or cpu: the thread's CPU time, for a machine shared with other jobs")
    parser.add_argument("--out", type=Path, default=Path("docs/bench"), help="output folder (default docs/bench)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = SpeedConfig(model=args.model, tokens=args.tokens, rounds=args.rounds, batch=args.batch,
                         max_verify=args.max_verify,
                         dtypes=tuple(args.dtypes.split(",")), backends=tuple(args.backends.split(",")),
                         peers=not args.no_peers, device=args.device, clock=args.clock)
    paths = write_speed_report(run_speed(config), args.out)
    print(paths["report"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
