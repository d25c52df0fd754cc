# Record: how docs/bench/perplexity.md and perplexity.json were made: python docs/bench/perplexity.py --conversations 10 --max-len 256
"""Held-out ShareGPT perplexity of the default model per weight format: the GGUF's matrices as shipped (Q4_1, the
quantized default), re-quantized at load (Q8_0, Q4_0), and the dequantised model in bfloat16 and float32.

Perplexity is over the assistant tokens of the first `--conversations` held-out conversations (catalog/sharegpt.py's
split), each cut at `--max-len` tokens and scored in one cached forward (the path decoding takes).

    python docs/bench/perplexity.py [--conversations 24] [--max-len 512] [--out docs/bench/perplexity]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from specdecode.catalog.registry import DEFAULT_MODEL, pull
from specdecode.catalog.sharegpt import fetch, load_conversations, render_tokens, split
from specdecode.model.loading import load_model
from specdecode.model.quant import quantized_format
from specdecode.model.tokenizer import Tokenizer

FORMATS = {  # label: (dtype, quantization)
    "bfloat16 (dequantised)": ("bfloat16", None),
    "float32 (dequantised)": ("float32", None),
    "Q4_1 as shipped (default)": ("float32", "gguf"),
    "Q8_0 at load": ("float32", "q8_0"),
    "Q4_0 at load": ("float32", "q4_0"),
}


def negative_log_likelihood(model, ids: list[int], is_answer: list[bool]) -> tuple[float, int]:
    """Sum of -log p(token) over the answer tokens of one conversation, and their count."""
    tokens = torch.tensor([ids])
    cache = model.make_cache(1, len(ids))
    with torch.inference_mode():
        logits = model(tokens, cache=cache).logits[0, :-1].float()  # predicts tokens 1..n-1
    logp = torch.log_softmax(logits, dim=-1).gather(1, tokens[0, 1:, None])[:, 0]
    mask = torch.tensor(is_answer[1:])
    return float(-logp[mask].sum()), int(mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/perplexity"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_path = pull(DEFAULT_MODEL, quiet=True)
    tokenizer = Tokenizer(model_path)
    _, heldout = split(load_conversations(fetch(quiet=True)))
    samples = [render_tokens(c, tokenizer, args.max_len) for c in heldout[:args.conversations]]
    samples = [(ids, mask) for ids, mask in samples if any(mask[1:])]
    rows = []
    for label, (dtype, quantization) in FORMATS.items():
        model = load_model(model_path, dtype=dtype, quantization=quantization)
        start, nll, count = time.perf_counter(), 0.0, 0
        for i, (ids, mask) in enumerate(samples):
            part, n = negative_log_likelihood(model, ids, mask)
            nll, count = nll + part, count + n
            print(f"\r{label}: {i + 1}/{len(samples)} conversations", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        weights = sum(b.numel() * b.element_size() for b in model.buffers()) + sum(
            p.numel() * p.element_size() for p in model.parameters())
        rows.append({"format": label, "dtype": dtype, "quantization": quantization or "none",
                     "weights": quantized_format(model) or dtype, "perplexity": math.exp(nll / count),
                     "tokens": count, "weight_bytes": weights, "seconds": time.perf_counter() - start})
        del model
    reference = next(r["perplexity"] for r in rows if r["dtype"] == "bfloat16" and r["quantization"] == "none")
    lines = [f"Held-out ShareGPT perplexity of {DEFAULT_MODEL} over the assistant tokens of {len(samples)} "
             f"conversations (<= {args.max_len} tokens each, {rows[0]['tokens']} scored tokens); "
             f"`python docs/bench/perplexity.py --conversations {args.conversations} --max-len {args.max_len}`.", "",
             "| weights | activations | perplexity | vs bfloat16 dequantised | weight bytes in memory |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['format']} ({r['weights']}) | {r['dtype']} | {r['perplexity']:.4f} | "
                     f"{r['perplexity'] / reference:.4f}x | {r['weight_bytes'] / 1e6:.0f} MB |")
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
