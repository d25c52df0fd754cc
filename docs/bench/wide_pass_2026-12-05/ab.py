# Record: how the figures of docs/bench/wide_pass_2026-12-05 were made (see README.md there).
"""Two builds of the kernels on one model, in one process: a cached forward of W new tokens after C tokens of
context (a verify pass over a chain of W), each build on its own packed copy of the weights, the builds taking turns
round by round; the fastest of the rounds, one thread, the calling thread's CPU clock. Prints, per build, each
width's milliseconds and its cost relative to the same build's one-token step.

    python docs/bench/wide_pass_2026-12-05/ab.py MODEL.gguf OLD.so [--widths 1,5,9,16] [--rounds 7] [--context 300]
        [--bits 512,256] [--k-blocks 32,256]   (the new build's vector widths and K-quant activation blocks to time)

Also checks that the builds give the same logits bit for bit on the widest pass (the old build's numbers are the new
one's with activations per 32).
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
        generator = torch.Generator().manual_seed(0)  # the same context for every build
        model(torch.randint(0, model.config.vocab_size, (1, context), generator=generator), cache=cache)
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
    parser.add_argument("--k-blocks", default="32,256", help="the new build's K-quant activation blocks to time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    widths = [int(v) for v in args.widths.split(",")]
    new = compiled.quant()
    bits = [int(b) for b in args.bits.split(",") if int(b) in ((512, 256) if new.vector_bits() == 512 else (256,))]
    with torch.inference_mode():
        models = {"old": loaded_with(load_build(args.old), args.model, args.context, max(widths)),
                  "new": loaded_with(new, args.model, args.context, max(widths))}
        blocks = [int(b) for b in args.k_blocks.split(",")]
        runs = [("old", None, None)] + [("new", b, k) for b in bits for k in blocks]
        best = {run: {w: float("inf") for w in widths} for run in runs}
        tokens = {w: torch.randint(0, 1000, (1, w)) for w in widths}
        wide = tokens[max(widths)]
        logits = {}
        for name, b, k in runs[:2]:
            if b is not None:
                new.set_vector_bits(b), new.set_k_activation_block(k)
            model, cache = models[name]
            logits[name] = model(wide, cache=cache).logits
        same = torch.equal(logits["old"], logits["new"])
        print(json.dumps({"same_logits_as_old": same, "width": max(widths)}), flush=True)
        for r in range(args.rounds):
            for run in runs:
                name, b, k = run
                if b is not None:
                    new.set_vector_bits(b), new.set_k_activation_block(k)
                model, cache = models[name]
                for w in widths:
                    model(tokens[w], cache=cache)  # warm
                    start = time.thread_time()
                    for _ in range(args.calls):
                        model(tokens[w], cache=cache)
                    best[run][w] = min(best[run][w], (time.thread_time() - start) / args.calls)
            print(f"round {r + 1}/{args.rounds}", flush=True)
    for (name, b, k), by_width in best.items():
        label = name if b is None else f"{name} {b}-bit, K-quant activations per {k}"
        print(json.dumps({"build": label,
                          "ms": {w: round(1000 * s, 2) for w, s in by_width.items()},
                          "cost": {w: round(s / by_width[1], 3) for w, s in by_width.items()}}), flush=True)


if __name__ == "__main__":
    main()
