# Record: how the figures of docs/bench/wide_pass_2026-12-05 were made (see README.md there).
"""Two builds of the kernels on one model, in one process: a cached forward of W new tokens after C tokens of
context (a verify pass over a chain of W), each build on its own packed copy of the weights, the builds taking turns
round by round; the fastest of the rounds, one thread, the calling thread's CPU clock. Prints, per build, each
width's milliseconds and its cost relative to the same build's one-token step.

    python docs/bench/wide_pass_2026-12-05/ab.py MODEL.gguf OLD.so [--widths 1,5,9,16] [--rounds 7] [--context 300]
        [--bits 512,256]   (the new build's vector widths to time; each is a column)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

import specdecode.kernels as compiled
from specdecode.model.loading import load_model


def load_build(path: Path):
    """A compiled kernels module from its .so (its module name is its file name)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def loaded_with(module, path: Path, context: int, width: int):
    """The model packed by `module`'s kernels, its fused layers prepared with them, and a cache holding context."""
    saved = compiled.quant
    compiled.quant = lambda: module
    try:
        model = load_model(path, dtype="float32", quantization="gguf")
        cache = model.make_cache(1, context + width)
        model(torch.randint(0, model.config.vocab_size, (1, context)), cache=cache)
        cache.advance(torch.tensor([0]), context)
    finally:
        compiled.quant = saved
    return model, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("old", type=Path, help="the other build's .so")
    parser.add_argument("--widths", default="1,5,9,16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--bits", default="512,256", help="the new build's vector widths to time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    widths = [int(v) for v in args.widths.split(",")]
    new = compiled.quant()
    bits = [int(b) for b in args.bits.split(",") if int(b) in ((512, 256) if new.vector_bits() == 512 else (256,))]
    with torch.inference_mode():
        models = {"old": loaded_with(load_build(args.old), args.model, args.context, max(widths)),
                  "new": loaded_with(new, args.model, args.context, max(widths))}
        runs = [("old", None)] + [("new", b) for b in bits]
        best = {(name, b): {w: float("inf") for w in widths} for name, b in runs}
        tokens = {w: torch.randint(0, 1000, (1, w)) for w in widths}
        for r in range(args.rounds):
            for name, b in runs:
                if b is not None:
                    new.set_vector_bits(b)
                model, cache = models[name]
                for w in widths:
                    model(tokens[w], cache=cache)  # warm
                    start = time.thread_time()
                    for _ in range(args.calls):
                        model(tokens[w], cache=cache)
                    best[(name, b)][w] = min(best[(name, b)][w], (time.thread_time() - start) / args.calls)
            print(f"round {r + 1}/{args.rounds}", flush=True)
    for (name, b), by_width in best.items():
        label = name if b is None else f"{name} {b}-bit"
        print(json.dumps({"build": label, "isa": new.instruction_set() if b else "old",
                          "ms": {w: round(1000 * s, 2) for w, s in by_width.items()},
                          "cost": {w: round(s / by_width[1], 3) for w, s in by_width.items()}}), flush=True)


if __name__ == "__main__":
    main()
