# Record: how the batch-64 probe-cost figure of docs/benchmarks.md (2026-11-30) was made: python docs/bench/sharegpt/adaptive_probe_cost.py --batch 64
"""Where adaptive speculation loses at a large batch: the same speculative engine with K forced to 0, adaptive as
it runs, and plain decoding, on the process's CPU clock (robust to other jobs on a shared machine).

One batch of held-out ShareGPT prompts (their last 128 tokens), greedy, EOS ignored; each mode runs `--repeats`
times, interleaved; the least CPU time of each counts.

    python docs/bench/sharegpt/adaptive_probe_cost.py --batch 64 --max-tokens 32 --repeats 3
"""
from __future__ import annotations

import argparse

import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.categories import heldout_workloads
from specdecode.bench.sweep import _timed_generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--method", default="ngram")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    sizes = {"max_num_seqs": args.batch, "max_model_len": 128 + args.max_tokens + 2 * args.k + 64}
    plain = LLM(None, dtype="float32", **sizes)
    spec = LLM(None, dtype="float32", speculative_config={"method": args.method, "num_speculative_tokens": args.k},
               **sizes)
    prompts = [spec.tokenizer.encode_chat(p.messages)[-128:] for ps in heldout_workloads(16).values() for p in ps]
    prompts = [prompts[i % len(prompts)] for i in range(args.batch)]
    for llm in (plain, spec):  # first calls pay one-time costs
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    cpu = {"plain": [], "speculative engine, K=0": [], "adaptive": []}
    drafted = []
    for _ in range(args.repeats):
        cpu["plain"].append(_timed_generate(plain, prompts, args.max_tokens)["decode_cpu_seconds"])
        spec.controller.fixed_k = 0
        cpu["speculative engine, K=0"].append(_timed_generate(spec, prompts, args.max_tokens)["decode_cpu_seconds"])
        spec.controller.fixed_k = None
        run = _timed_generate(spec, prompts, args.max_tokens)
        cpu["adaptive"].append(run["decode_cpu_seconds"])
        drafted.append(run["draft_tokens"])
    base = min(cpu["plain"])
    for mode, seconds in cpu.items():
        print(f"{mode}: {min(seconds):.2f} CPU-s ({base / min(seconds):.3f}x plain's throughput)")
    print(f"adaptive drafted {drafted} tokens per run over {args.batch} x {args.max_tokens - 1} decode steps")


if __name__ == "__main__":
    main()
