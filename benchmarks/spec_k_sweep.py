"""Speculative decoding vs plain decoding at batch 1, greedy, for draft lengths K, chains and trees.

    python benchmarks/spec_k_sweep.py [--prompts 8] [--max-tokens 128] [--json out.json]

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
from specdecode.sampling import SamplingParams


def configs(draft: str, ks: list[int]) -> list[tuple[str, str, dict | None]]:
    """(workload, label, speculative_config) in the order they run."""
    out = [("completion", "plain", None), ("grounded_edit", "plain", None)]
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
    from specdecode.models import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEFAULT_TARGET_DIR))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT_DIR))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", default="2,4,6,8")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = {w: load_workload(w, args.prompts) for w in ("completion", "grounded_edit")}
    plain_tps, rows = {}, []
    for workload, label, spec in tqdm(configs(args.draft, [int(k) for k in args.ks.split(",")]), desc="configs"):
        llm = LLM(args.target, dtype="float32", speculative_config=spec)
        llm.generate(prompts[workload][:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        result = run_prompts(llm, prompts[workload], params)
        if spec is None:
            plain_tps[workload] = result.tokens_per_s
        rows.append({"workload": workload, "config": label, "tokens_per_s": result.tokens_per_s,
                     "speedup": result.tokens_per_s / plain_tps[workload],
                     "mean_accepted_len": result.stats.mean_accepted_len,
                     "acceptance_rate": result.stats.acceptance_rate})
    print("| workload | config | tokens/s | speedup | tokens/step | acceptance |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['config']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['mean_accepted_len']:.2f} | {r['acceptance_rate']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
