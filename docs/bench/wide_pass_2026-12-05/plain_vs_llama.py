# Record: how the plain-decoding figures of docs/bench/wide_pass_2026-12-05 were made (see README.md there).
"""Plain greedy decoding, ours against llama.cpp's (`llama-completion`), on the same GGUF, prompt text and prompt token
ids, one thread each, interleaved round by round (the fastest round counts): decode tokens/s = tokens after the first
/ seconds after the first token, as `specdecode bench --speed` counts them.

    python docs/bench/wide_pass_2026-12-05/plain_vs_llama.py BIN_DIR [--models a,b,c] [--tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from specdecode.bench.llama_cpp import LlamaCpp
from specdecode.bench.measure import trace_generate
from specdecode.catalog.registry import resolve_model
from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams

QUESTION = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bin_dir")
    parser.add_argument("--models", default="qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct,"
                                            "smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    peer = LlamaCpp(args.bin_dir, threads=1)
    for name in args.models.split(","):
        gguf = resolve_model(name)
        llm = LLM(model=name, speculative_config=None, threads=1)
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        ours, theirs = 0.0, 0.0
        for _ in range(args.rounds):
            trace = trace_generate(llm, ids, params)
            ours = max(ours, (len(trace.token_ids) - 1) / (trace.seconds - trace.ttft))
            theirs = max(theirs, peer.complete(gguf, text, args.tokens, len(ids)).decode_tokens_per_s)
        print(json.dumps({"model": name, "ours_tokens_per_s": round(ours, 2), "llama_cpp_tokens_per_s": round(theirs, 2),
                          "ratio": round(ours / theirs, 3), "same_prompt_ids": peer.tokenize(gguf, text) == ids,
                          "load_average": os.getloadavg()[0]}), flush=True)
        del llm


if __name__ == "__main__":
    main()
