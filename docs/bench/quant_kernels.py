# Record: how the quantized-kernel figures of docs/bench/speed_kernels.md were made: python docs/bench/quant_kernels.py --model FILE.gguf --against OLD.so
"""The block-quantized kernels (kernels/quant.cpp) on a GGUF's own matrices: all the model's quantized linears for
M rows at once (GMAC/s, GB/s of weights), and a whole cached forward of W new tokens after C tokens of context;
1 thread, the calling thread's CPU clock, fastest of interleaved rounds. One JSON line per figure. With --against,
another build of the kernels (e.g. an older checkout's, from ~/.cache/specdecode/kernels) runs in the same process
on the same inputs, round for round alternating with this checkout's: the fair comparison on a shared machine.

    python docs/bench/quant_kernels.py --model FILE.gguf [--ms 1,4,8,16,32,256] [--widths 1,4,8,16] [--context 300]
        [--against OTHER.so]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

from specdecode.model.loading import load_model
from specdecode.model.quant import QuantLinear


def fastest(fn, rounds: int, reps: int, builds: dict, use) -> dict:
    """Seconds per call of fn for each build: the fastest of `rounds` rounds of `reps` calls (each round after one
    warm-up call), the builds taking turns round by round."""
    best = {name: float("inf") for name in builds}
    for _ in range(rounds):
        for name, module in builds.items():
            use(module)
            fn()
            start = time.thread_time()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.thread_time() - start) / reps)
    return best


def load_build(path: Path):
    """A compiled kernels module from its .so file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--ms", default="1,4,8,16,32,256", help="rows per product (comma-separated)")
    parser.add_argument("--widths", default="1,4,8,16", help="new tokens per cached forward (comma-separated)")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tag", default="", help="a label copied into every line (e.g. which checkout)")
    parser.add_argument("--against", type=Path, default=None, help="another build (.so) to alternate with")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model(args.model, dtype="float32", quantization="gguf")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    macs = sum(m.in_features * m.out_features for m in linears)
    weight_bytes = sum(m.bytes_read() for m in linears)
    from specdecode.model.quant import kernels
    common = {"tag": args.tag, "isa": kernels().instruction_set()}
    builds = {"this": kernels()}
    if args.against is not None:
        builds["against"] = load_build(args.against)
    cache = model.make_cache(1, 1)
    fused = model.fused_layers(cache)

    def use(module):  # every product and fused layer through this build
        for m in linears:
            m._kernel = module.qmatmul_parts
        if fused is not None:
            model.__dict__["_fused_layers"] = (module.layer_step, *fused[1:])

    with torch.inference_mode():
        for M in (int(v) for v in args.ms.split(",") if v):
            xs = [torch.randn(M, m.in_features) for m in linears]

            def all_linears():
                for m, x in zip(linears, xs):
                    m(x)

            for name, seconds in fastest(all_linears, args.rounds, max(1, 8 // M), builds, use).items():
                print(json.dumps({**common, "build": name, "what": "linears", "M": M, "ms": round(1000 * seconds, 3),
                                  "GMAC/s": round(macs * M / seconds / 1e9, 2),
                                  "GB/s": round(weight_bytes / seconds / 1e9, 2)}), flush=True)
        for width in (int(v) for v in args.widths.split(",") if v):
            cache = model.make_cache(1, args.context + width)
            use(builds["this"])
            model(torch.randint(0, model.config.vocab_size, (1, args.context)), cache=cache)
            cache.advance(torch.tensor([0]), args.context)
            tokens = torch.randint(0, model.config.vocab_size, (1, width))
            for name, seconds in fastest(lambda: model(tokens, cache=cache), args.rounds, 5, builds, use).items():
                print(json.dumps({**common, "build": name, "what": "forward", "context": args.context,
                                  "width": width, "ms": round(1000 * seconds, 3)}), flush=True)


if __name__ == "__main__":
    main()
