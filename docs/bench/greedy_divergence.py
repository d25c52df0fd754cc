# Record: how docs/bench/speed_divergence_{bfloat16,float32}.json (docs/exactness.md) were made: python docs/bench/greedy_divergence.py --model /path/to/SmolLM2 --dtype bfloat16 --out docs/bench/speed_divergence_bfloat16.json
"""How often greedy speculative decoding (prompt lookup, `ngram`) gives other tokens than greedy plain decoding,
in a given dtype: verifying K+1 tokens and decoding one run the matrix products with other shapes, so their
reduced-precision roundings differ and a near-tie between two tokens can flip.

Prompts: chat-templated requests about real code, the source of functions from Python's standard library
(deterministic for a given Python version). Batch 1, up to --tokens tokens each (EOS ends both the same way).

    python docs/bench/greedy_divergence.py --model DIR --dtype bfloat16 [--prompts 200] [--tokens 128]
"""
from __future__ import annotations

import argparse
import ast
import json
import sysconfig
import time
from pathlib import Path

import torch

from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams

MODULES = ("argparse", "ast", "calendar", "collections/__init__", "configparser", "csv", "difflib", "dis",
           "email/utils", "fractions", "ftplib", "functools", "gettext", "glob", "gzip", "heapq", "inspect",
           "ipaddress", "json/decoder", "json/encoder", "logging/__init__", "mailbox", "ntpath", "os", "pathlib",
           "pickle", "platform", "posixpath", "pprint", "queue", "random", "shutil", "smtplib", "statistics",
           "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tokenize", "traceback",
           "urllib/parse", "uuid", "zipfile")
INSTRUCTIONS = ("Explain what this Python function does, step by step.",
                "Write a docstring and two example calls for this Python function.")


def stdlib_functions(count: int, min_lines: int = 6, max_lines: int = 30) -> list[str]:
    """Sources of `count` standard-library functions of min_lines..max_lines lines, round-robin over MODULES."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    per_module = []
    for name in MODULES:
        path = stdlib / f"{name}.py"
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()
        found = [("\n".join(lines[node.lineno - 1:node.end_lineno]))
                 for node in ast.walk(ast.parse(text))
                 if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines]
        per_module.append(found)
    out = []
    while len(out) < count and any(per_module):
        for found in per_module:
            if found and len(out) < count:
                out.append(found.pop(0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens of prompt lookup (default 8)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True, help="JSON file, rewritten after every prompt")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plain = LLM(args.model, dtype=args.dtype, device="cpu", max_num_seqs=1)
    spec = LLM(args.model, dtype=args.dtype, device="cpu", max_num_seqs=1,
               speculative_config={"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                                   "prompt_lookup_min": 2})
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    rows = []
    start = time.perf_counter()
    for i, source in enumerate(stdlib_functions(args.prompts)):
        message = f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n```python\n{source}\n```"
        ids = plain.tokenizer.encode_chat([{"role": "user", "content": message}])
        a = plain.generate([ids], params)[0].outputs[0].token_ids
        b = spec.generate([ids], params)[0].outputs[0].token_ids
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        rows.append({"prompt_tokens": len(ids), "plain_tokens": len(a), "spec_tokens": len(b), "first_diff": first})
        diverged = sum(r["first_diff"] is not None for r in rows)
        summary = {"model": str(args.model), "dtype": args.dtype, "tokens": args.tokens, "k": args.k,
                   "prompts": len(rows), "diverged": diverged, "rate": diverged / len(rows),
                   "seconds": time.perf_counter() - start,
                   "acceptance_rate": spec.total_stats.acceptance_rate if spec.total_stats.draft_tokens else None,
                   "rows": rows}
        args.out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
        print(f"{len(rows)}/{args.prompts}: diverged {diverged} ({100 * diverged / len(rows):.1f}%)", flush=True)


if __name__ == "__main__":
    main()
