# Record: how the Lookahead / REST table of docs/methods.md was made: python docs/bench/lookahead_rest.py --prompts 8 --max-tokens 128 --threads 1
"""Lookahead, REST, prompt lookup and the shipped speculators vs plain decoding on held-out ShareGPT, adaptive
(the default) and fixed K.

Two workloads, both from held-out ShareGPT conversations (never in REST's datastore), in the chat template:
`chat` = the first user turn as it is (open chat); `grounded` = a request to rewrite or summarise a text the user
gives (the held-out assistant answer), which a model answers largely from its input. Greedy, batch 1; every
engine decodes each prompt in turn (plain first), so machine load hits all alike; speedups are ratios of summed
wall times in this run.

    python docs/bench/lookahead_rest.py --prompts 10 --max-tokens 128 --threads 1
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

METHODS = {"ngram": {"method": "ngram"}, "lookahead": {"method": "lookahead"}, "rest": {"method": "rest"},
           "eagle": {"method": "eagle"}, "medusa": {"method": "medusa"}, "draft_model": {"method": "draft_model"}}
"""Each with the default model's shipped speculator or datastore where it needs one."""
GROUNDED = ["Rewrite the following text in simpler words, keeping everything it says:\n\n{text}",
            "Summarise the following text:\n\n{text}"]


def heldout_prompts(tokenizer, n: int, max_prompt_tokens: int) -> dict[str, list[list[int]]]:
    """{workload: chat-templated prompt ids} from held-out conversations in hash order (as
    docs/bench/speculators/heldout_speculators.py takes them)."""
    _, heldout = sharegpt.split(sharegpt.load_conversations(sharegpt.fetch(quiet=True)))
    prompts: dict[str, list[list[int]]] = {"chat": [], "grounded": []}
    for conv in speculators.hash_order(heldout):
        text, answer = sharegpt.first_turn_prompt(conv, tokenizer)
        ids = tokenizer.encode(text)
        if len(prompts["chat"]) < n and len(ids) <= max_prompt_tokens:
            prompts["chat"].append(ids)
        if len(prompts["grounded"]) < n and 200 <= len(answer) <= 2000:
            request = GROUNDED[len(prompts["grounded"]) % len(GROUNDED)].format(text=answer.strip())
            ids = tokenizer.encode_chat([{"role": "user", "content": request}])
            if len(ids) <= max_prompt_tokens:
                prompts["grounded"].append(ids)
        if all(len(p) == n for p in prompts.values()):
            return prompts
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="target (default: smollm2-135m-instruct)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    parser.add_argument("--fixed", action="store_true", help="also run every method with a fixed K (--no-adaptive)")
    parser.add_argument("--prompts", type=int, default=10, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=640)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench_results/lookahead_rest.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    engines = {"plain": LLM(args.model, dtype=args.dtype, max_num_seqs=1)}
    started = time.perf_counter()
    for name in args.methods.split(","):
        engines[name] = LLM(args.model, dtype=args.dtype, speculative_config=dict(METHODS[name]), max_num_seqs=1)
        if args.fixed:
            engines[f"{name} fixed K"] = LLM(args.model, dtype=args.dtype, max_num_seqs=1,
                                             speculative_config={**METHODS[name], "adaptive": False})
    print(f"engines ready in {time.perf_counter() - started:.0f} s (start-up timing and REST's datastore)")
    workloads = heldout_prompts(engines["plain"].tokenizer, args.prompts, args.max_prompt_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in engines.values():  # warm-up: first-call costs stay out of the timings
        llm.generate([workloads["chat"][0]], SamplingParams(temperature=0, max_tokens=8))
    results = {}
    for workload, prompts in workloads.items():
        totals = {name: {"seconds": 0.0, "tokens": 0, "steps": 0, "draft_tokens": 0, "accepted": 0,
                         "same_as_plain": 0} for name in engines}
        for ids in tqdm(prompts, desc=workload):
            reference = None
            for name, llm in engines.items():
                begin = time.perf_counter()
                out = llm.generate([ids], params)[0]
                t = totals[name]
                t["seconds"] += time.perf_counter() - begin
                t["tokens"] += len(out.outputs[0].token_ids)
                t["steps"] += out.metrics.steps
                t["draft_tokens"] += out.metrics.draft_tokens
                t["accepted"] += out.metrics.accepted_tokens
                reference = out.outputs[0].token_ids if name == "plain" else reference
                t["same_as_plain"] += int(out.outputs[0].token_ids == reference)
        plain = totals["plain"]
        results[workload] = {name: {
            "tokens_per_s": t["tokens"] / t["seconds"],
            "speedup": (t["tokens"] / t["seconds"]) / (plain["tokens"] / plain["seconds"]),
            "tokens_per_target_pass": (t["tokens"] - len(prompts)) / max(1, t["steps"]),
            "acceptance_rate": t["accepted"] / t["draft_tokens"] if t["draft_tokens"] else None,
            "same_tokens_as_plain": f"{t['same_as_plain']}/{len(prompts)}", **t} for name, t in totals.items()}
    report = {"args": vars(args) | {"out": str(args.out)}, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for workload, rows in results.items():
        print(f"\n{workload} ({len(workloads[workload])} prompts)\n")
        print(method_table(rows, "vs plain"))

if __name__ == "__main__":
    main()
