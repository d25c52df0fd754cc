"""The block-quantized kernels (kernels/quant.cpp) on a GGUF's own matrices: all the model's quantized linears for
M rows at once (GMAC/s, GB/s of weights), and a whole cached forward of W new tokens after C tokens of context;
1 thread, the calling thread's CPU clock, fastest of interleaved rounds. One JSON line per figure, so that runs
against two checkouts (PYTHONPATH) can be interleaved and compared.

    python benchmarks/quant_kernels.py --model FILE.gguf [--ms 1,4,8,16,32,256] [--widths 1,4,8,16] [--context 300]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdecode.model.loading import load_model
from specdecode.model.quant import QuantLinear


def fastest(fn, rounds: int, reps: int) -> float:
    """Seconds per call of fn: the fastest of `rounds` rounds of `reps` calls (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.thread_time() - start) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--ms", default="1,4,8,16,32,256", help="rows per product (comma-separated)")
    parser.add_argument("--widths", default="1,4,8,16", help="new tokens per cached forward (comma-separated)")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tag", default="", help="a label copied into every line (e.g. which checkout)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model(args.model, dtype="float32", quantization="gguf")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    macs = sum(m.in_features * m.out_features for m in linears)
    weight_bytes = sum(m.qweight.numel() for m in linears)
    from specdecode.model.quant import kernels
    common = {"tag": args.tag, "isa": kernels().instruction_set()}
    with torch.inference_mode():
        for M in (int(v) for v in args.ms.split(",")):
            xs = [torch.randn(M, m.in_features) for m in linears]

            def all_linears():
                for m, x in zip(linears, xs):
                    m(x)

            seconds = fastest(all_linears, args.rounds, max(1, 8 // M))
            print(json.dumps({**common, "what": "linears", "M": M, "ms": round(1000 * seconds, 3),
                              "GMAC/s": round(macs * M / seconds / 1e9, 2),
                              "GB/s": round(weight_bytes / seconds / 1e9, 2)}), flush=True)
        for width in (int(v) for v in args.widths.split(",")):
            cache = model.make_cache(1, args.context + width)
            model(torch.randint(0, model.config.vocab_size, (1, args.context)), cache=cache)
            cache.advance(torch.tensor([0]), args.context)
            tokens = torch.randint(0, model.config.vocab_size, (1, width))
            seconds = fastest(lambda: model(tokens, cache=cache), args.rounds, 5)
            print(json.dumps({**common, "what": "forward", "context": args.context, "width": width,
                              "ms": round(1000 * seconds, 3)}), flush=True)


if __name__ == "__main__":
    main()
