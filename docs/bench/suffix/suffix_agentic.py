# Record: how agentic_edit.json and README.md here (docs/methods.md) was made: python docs/bench/suffix/suffix_agentic.py --threads 1 --auto --out docs/bench/suffix/agentic_edit.json
"""Suffix decoding against plain decoding and prompt lookup on the agentic edit-loop workload
(specdecode/bench/agentic_workload.py): greedy, batch 1, the requests in order through one engine per method, so
the suffix tree warms across requests. Each request runs on every engine in turn (the order rotating per request),
so a change of load on the machine hits all engines alike; speeds are only compared as ratios within the run. The
greedy outputs must be identical across engines (they are the same tokens, so the ratios compare equal work).

    python docs/bench/suffix/suffix_agentic.py --threads 1 --out docs/bench/suffix/agentic_edit.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from specdecode.bench import agentic_workload
from specdecode.engine.llm import LLM
from specdecode.hardware import cpu_name
from specdecode.sampling import SamplingParams


def engines(args) -> dict[str, dict | None]:
    """Mode -> speculative_config (None: plain decoding)."""
    k = args.num_speculative_tokens
    out = {"plain": None,
           "suffix": {"method": "suffix", "num_speculative_tokens": k},
           "ngram": {"method": "ngram", "num_speculative_tokens": args.ngram_tokens}}
    if args.auto:
        out["auto"] = {"method": "auto", "num_speculative_tokens": k}
    return out


def totals(rows: list[dict], mode: str) -> dict:
    tokens = sum(r[mode]["tokens"] for r in rows)
    seconds = sum(r[mode]["seconds"] for r in rows)
    passes = sum(r[mode]["target_passes"] for r in rows)
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2),
            "target_passes": passes, "tokens_per_target_pass": round(tokens / passes, 3)}


def summary(rows: list[dict], modes: list[str]) -> dict:
    out = {mode: totals(rows, mode) for mode in modes}
    plain = out["plain"]["tokens_per_second"]
    for mode in modes[1:]:
        out[mode]["speedup_vs_plain"] = round(out[mode]["tokens_per_second"] / plain, 3)
    if "suffix" in out and "ngram" in out:
        out["suffix"]["speedup_vs_ngram"] = round(out["suffix"]["tokens_per_second"]
                                                  / out["ngram"]["tokens_per_second"], 3)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target (default: smollm2-135m-instruct)")
    p.add_argument("--sessions", type=int, default=None, help="first N sessions only (default: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, default=16)
    p.add_argument("--ngram-tokens", type=int, default=8, help="prompt lookup's K (its own default, 8: it measured "
                   "better than 16 here)")
    p.add_argument("--auto", action="store_true", help="also the auto method (prompt lookup and suffix in one tree)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, default=Path("docs/bench/suffix/agentic_edit.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    configs = engines(args)
    modes = list(configs)
    llms = {mode: LLM(args.model, dtype=args.dtype, speculative_config=config, max_num_seqs=1, threads=args.threads)
            for mode, config in configs.items()}
    tokenizer = llms["plain"].tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = tokenizer.encode_chat([{"role": "user", "content": "Say hello."}])
    for llm in llms.values():  # first-call costs out of the way (a short unrelated request)
        llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=8))

    requests = agentic_workload.load(args.sessions)
    rows = []
    for i, request in enumerate(requests):
        ids = tokenizer.encode_chat(request["messages"])
        row = {"source": request["source"], "prompt_tokens": len(ids)}
        outputs = {}
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            start = time.perf_counter()
            out = llms[mode].generate([ids], params)[0]
            seconds = time.perf_counter() - start
            outputs[mode] = out.outputs[0].token_ids
            stats = out.metrics
            row[mode] = {"tokens": len(outputs[mode]), "seconds": round(seconds, 4),
                         "target_passes": 1 + stats.steps, "accepted_tokens": stats.accepted_tokens,
                         "draft_tokens": stats.draft_tokens}
        row["identical"] = all(outputs[m] == outputs["plain"] for m in modes)
        rows.append(row)
        line = "  ".join(f"{m} {row[m]['tokens'] / row[m]['seconds']:.1f} tok/s" for m in modes)
        print(f"[{i + 1}/{len(requests)}] {request['source']}: {row['plain']['tokens']} tokens  {line}"
              f"{'' if row['identical'] else '  OUTPUTS DIFFER'}", flush=True)

    turns = agentic_workload.TURNS
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "workload": f"{agentic_workload.NAME} ({len(requests)} requests, sessions of {turns}; "
                    "specdecode/bench/agentic_workload.py)",
        "model": args.model or "smollm2-135m-instruct", "dtype": args.dtype, "batch": 1, "greedy": True,
        "max_tokens": args.max_tokens, "torch_threads": torch.get_num_threads(),
        "speculative_configs": {m: c for m, c in configs.items() if c},
        "machine": {"cpu": cpu_name(), "python": platform.python_version(), "torch": torch.__version__},
        "all_outputs_identical": all(r["identical"] for r in rows),
        "overall": summary(rows, modes),
        "first_turn_of_each_session": summary(rows[0::turns], modes),
        "later_turns": summary([r for i, r in enumerate(rows) if i % turns], modes),
        "requests": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("overall", "first_turn_of_each_session", "later_turns")}, indent=1))
    return 0 if result["all_outputs_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
