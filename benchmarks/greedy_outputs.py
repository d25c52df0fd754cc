"""Greedy outputs of plain decoding and every method on the built-in chat prompts, as JSON: run it once per version
of the code (PYTHONPATH picks which), then `--compare A.json B.json` says how many outputs are identical. The
renovation's "behaviour unchanged" check.

    PYTHONPATH=/path/to/old/checkout python benchmarks/greedy_outputs.py old.json --prompts 12 --max-tokens 64
    python benchmarks/greedy_outputs.py new.json --prompts 12 --max-tokens 64
    python benchmarks/greedy_outputs.py --compare old.json new.json
"""
from __future__ import annotations

import argparse
import json
import sys

METHODS = [None, "ngram", "draft_model", "eagle", "medusa", "lookahead", "rest"]


def run(out: str, prompts: int, max_tokens: int, dtype: str) -> None:
    import torch

    from specdecode import LLM, SamplingParams
    from specdecode.certify.prompts import BUILTIN

    torch.set_num_threads(1)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = {}
    for method in METHODS:
        config = None if method is None else {"method": method, "num_speculative_tokens": 3, "adaptive": False}
        llm = LLM(dtype=dtype, speculative_config=config)
        ids = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in BUILTIN[:prompts]]
        outputs[str(method)] = [o.outputs[0].token_ids for o in llm.generate(ids, params)]
        print(method, "done", file=sys.stderr, flush=True)
    with open(out, "w") as f:
        json.dump({"outputs": outputs}, f)


def compare(a: str, b: str) -> int:
    first, second = (json.load(open(path))["outputs"] for path in (a, b))
    differ = 0
    for method, rows in first.items():
        same = sum(x == y for x, y in zip(rows, second[method]))
        differ += len(rows) - same
        print(f"{method}: {same}/{len(rows)} identical")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    run(args.out, args.prompts, args.max_tokens, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
