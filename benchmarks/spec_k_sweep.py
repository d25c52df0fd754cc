"""Speculative decoding vs plain decoding at batch 1, greedy, for draft lengths K, chains and trees.

    python benchmarks/spec_k_sweep.py [--prompts 4] [--max-tokens 128] [--threads 1] [--json out.json]

Every configuration runs the same prompts in the same process; the speedup is tokens/s over plain decoding
measured in this run. Default models: the bundled target and draft.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.bench.runner import run_prompts
from specdecode.bench.workloads import load_workload
from specdecode.engine.llm import LLM
from specdecode.engine.sequence import SpecStats
from specdecode.sampling import SamplingParams


def configs(draft: str, ks: list[int]) -> list[tuple[str, str, dict]]:
    """(workload, label, speculative_config) in the order they run."""
    out = []
    for k in ks:
        out.append(("completion", f"draft chain K={k}", {"model": draft, "num_speculative_tokens": k}))
    for k in ks:
        out.append(("completion", f"draft tree 2xK={k}", {"model": draft, "num_speculative_tokens": k,
                                                            "num_drafts": 2}))
    for k in ks:
        out.append(("grounded_edit", f"ngram K={k}", {"method": "ngram", "num_speculative_tokens": k,
                                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2}))
    for k in ks:
        out.append(("grounded_edit", f"draft chain K={k}", {"model": draft, "num_speculative_tokens": k}))
    return out


def main() -> None:
    from specdecode.catalog import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEFAULT_TARGET_DIR))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT_DIR))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", default="2,4,6,8")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", default=None, help="run only the configurations whose label contains this text")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = [r for r in configs(args.draft, [int(k) for k in args.ks.split(",")])
            if args.only is None or args.only in r[1]]
    plain = LLM(args.target, dtype="float32")
    engines = [LLM(args.target, dtype="float32", speculative_config=spec) for _, _, spec in runs]
    for llm in [plain] + engines:  # warm-up: one-time allocations and lazy imports
        llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=8))
    workloads = {w: load_workload(w, args.prompts) for w in ("completion", "grounded_edit")
                 if any(r[0] == w for r in runs)}
    # Per prompt: plain, every configuration, plain again. Each configuration is compared with the mean of the
    # two plain runs around it on the same prompt, so slow changes in machine load cancel out of the ratio.
    plain_s = {w: 0.0 for w in workloads}
    spec = [{"seconds": 0.0, "tokens": 0, "stats": SpecStats()} for _ in runs]
    bar = tqdm(total=sum(len(p) for p in workloads.values()) * (len(runs) + 2), desc="runs")
    for workload, prompts in workloads.items():
        for prompt in prompts:
            before = run_prompts(plain, [prompt], params).seconds
            bar.update()
            for i, (w, _, _) in enumerate(runs):
                if w == workload:
                    result = run_prompts(engines[i], [prompt], params)
                    spec[i]["seconds"] += result.seconds
                    spec[i]["tokens"] += result.tokens
                    spec[i]["stats"].merge(result.stats)
                bar.update()
            after = run_prompts(plain, [prompt], params).seconds
            bar.update()
            plain_s[workload] += (before + after) / 2
    bar.close()
    rows = []
    for workload in workloads:
        tokens = args.max_tokens * len(workloads[workload])
        rows.append({"workload": workload, "config": "plain", "tokens_per_s": tokens / plain_s[workload],
                     "speedup": 1.0, "mean_accepted_len": 1.0, "acceptance_rate": 0.0})
    for (workload, label, _), r in zip(runs, spec):
        rows.append({"workload": workload, "config": label, "tokens_per_s": r["tokens"] / r["seconds"],
                     "speedup": plain_s[workload] / r["seconds"],
                     "mean_accepted_len": r["stats"].mean_accepted_len,
                     "acceptance_rate": r["stats"].acceptance_rate})
    print("| workload | config | tokens/s | speedup | tokens/step | acceptance |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['config']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['mean_accepted_len']:.2f} | {r['acceptance_rate']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
