# Record: how heldout_*.json here (docs/exactness.md, docs/training.md) were made, e.g. python docs/bench/speculators/heldout_speculators.py --prompts 8 --max-tokens 96 --temperature 1.0 --k 4 --method ngram --method eagle
"""Trained speculators on held-out ShareGPT first turns: tokens per target pass and speedup over plain decoding.

Every method decodes the same chat-templated prompts as plain decoding, batch 1, interleaved prompt by prompt
(plain, then each method), so machine load hits all alike; speedups are ratios of summed wall times in this run.

    python docs/bench/speculators/heldout_speculators.py --prompts 20 --max-tokens 128 --threads 1 \
        --method eagle=runs/eagle-head --method medusa=runs/medusa-head --method draft_model=runs/draft
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode import LLM, SamplingParams
from specdecode.bench.tables import method_table
from specdecode.catalog import sharegpt
from specdecode.train import speculators


def heldout_prompts(tokenizer, n: int, max_prompt_tokens: int) -> list[list[int]]:
    """The first user turn of held-out conversations (hash order), in the chat template, as token ids."""
    _, heldout = sharegpt.split(sharegpt.load_conversations(sharegpt.fetch(quiet=True)))
    prompts = []
    for conv in speculators.hash_order(heldout):
        text, _ = sharegpt.first_turn_prompt(conv, tokenizer)
        ids = tokenizer.encode(text)
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == n:
            break
    return prompts


def parse_method(spec: str) -> tuple[str, dict]:
    """`eagle=DIR`, `medusa=DIR`, `draft_model=DIR`, `ngram` -> (label, speculative_config)."""
    method, _, path = spec.partition("=")
    config = {"method": method}
    if path:
        config["model"] = path
    return method, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="target (default: smollm2-135m-instruct)")
    parser.add_argument("--method", action="append", default=[], help="METHOD[=DIR], repeatable")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens (tree depth for eagle/medusa)")
    parser.add_argument("--tree-nodes", type=int, default=None, help="eagle/medusa: nodes per tree")
    parser.add_argument("--adaptive", action="store_true", help="adaptive speculation (default: fixed K)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sampler", choices=("race", "rejection"), default="race",
                        help="SamplingParams.sampler: how sampled requests are drawn and verified")
    parser.add_argument("--out", type=Path, default=Path("bench_results/heldout_speculators.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    sizes = {"max_num_seqs": 1, "max_model_len": args.max_prompt_tokens + args.max_tokens + 64}  # batch 1: small caches
    engines = {"plain": LLM(args.model, dtype=args.dtype, **sizes)}
    for spec in args.method:
        label, config = parse_method(spec)
        config["num_speculative_tokens"] = args.k
        if args.tree_nodes and config["method"] in ("eagle", "medusa"):
            config["num_tree_nodes"] = args.tree_nodes
        config["adaptive"] = args.adaptive
        engines[label] = LLM(args.model, dtype=args.dtype, speculative_config=config, **sizes)
    prompts = heldout_prompts(engines["plain"].tokenizer, args.prompts, args.max_prompt_tokens)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0, sampler=args.sampler)
    totals = {name: {"seconds": 0.0, "tokens": 0, "steps": 0, "draft_tokens": 0, "accepted": 0,
                     "same_as_plain": 0} for name in engines}
    for llm in engines.values():  # warm-up: first-call costs stay out of the timings
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8))
    for ids in tqdm(prompts, desc="prompts"):
        reference = None
        for name, llm in engines.items():
            started = time.perf_counter()
            seq_out = llm.generate([ids], params)[0]
            seconds = time.perf_counter() - started
            out = seq_out.outputs[0]
            stats = seq_out.metrics
            t = totals[name]
            t["seconds"] += seconds
            t["tokens"] += len(out.token_ids)
            t["steps"] += stats.steps
            t["draft_tokens"] += stats.draft_tokens
            t["accepted"] += stats.accepted_tokens
            reference = out.token_ids if name == "plain" else reference
            t["same_as_plain"] += int(out.token_ids == reference)
    plain = totals["plain"]
    rows = {}
    for name, t in totals.items():
        rows[name] = {
            "tokens_per_s": t["tokens"] / t["seconds"],
            "speedup": (t["tokens"] / t["seconds"]) / (plain["tokens"] / plain["seconds"]),
            "tokens_per_target_pass": (t["tokens"] - len(prompts)) / max(1, t["steps"]),
            "acceptance_rate": t["accepted"] / t["draft_tokens"] if t["draft_tokens"] else None,
            "same_tokens_as_plain": f"{t['same_as_plain']}/{len(prompts)}",
            **t,
        }
    result = {"args": vars(args) | {"out": str(args.out)}, "prompts": len(prompts), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(method_table(rows))

if __name__ == "__main__":
    main()
