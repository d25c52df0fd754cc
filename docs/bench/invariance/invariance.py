# Record: how invariance.json here (docs/exactness.md) was made: python docs/bench/invariance/invariance.py --prompts 100 --max-tokens 128 --out docs/bench/invariance/invariance.json
"""The same answer at any batch and with any speculation: every method's outputs at batch 1, 8 and 32 against plain
decoding alone, on held-out ShareGPT first turns, in the default configuration (LLM()'s defaults: quantization and
dtype "auto", adaptive speculation).

Plain decoding at batch 1 gives the references: each prompt's greedy answer and its seeded T=1 answer (seed = the
prompt's index, the default race sampler). Then each method decodes every prompt greedy at batch 1, the first
`--seeded` prompts seeded at batch 1, and all prompts as mixed batches of 8 and 32 (even prompts greedy, odd ones
seeded), and every answer is compared token by token with its reference. End of sequence is ignored, so every answer
has --max-tokens tokens. The JSON is rewritten after each cell and a rerun with the same --out skips the cells it
holds, so a stopped run resumes.

    python docs/bench/invariance/invariance.py --prompts 100 --max-tokens 128 --out docs/bench/invariance/invariance.json
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode import LLM, SamplingParams
from specdecode.catalog import sharegpt
from specdecode.train import speculators

METHODS = ["plain", "ngram", "eagle", "medusa", "draft_model", "lookahead", "rest"]


def heldout_prompts(tokenizer, n: int, max_prompt_tokens: int) -> list[list[int]]:
    """The first user turn of held-out conversations (hash order), in the chat template, as token ids (the same as
    docs/bench/speculators/heldout_speculators.py's)."""
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


def params_for(index: int, seeded: bool, max_tokens: int) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=1.0, seed=index, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def engine(method: str, batch: int, max_len: int, fixed_k: int | None = None) -> LLM:
    config = None if method == "plain" else {"method": method}
    if config is not None and fixed_k:  # every step drafts K (adaptive drafts only what pays, often nothing)
        config.update(num_speculative_tokens=fixed_k, adaptive=False)
    return LLM(speculative_config=config, max_num_seqs=batch, max_model_len=max_len)


def decode(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], batch: int) -> tuple[list, float]:
    """Answers (token ids) and seconds: one request at a time at batch 1, else all submitted at once."""
    start = time.perf_counter()
    if batch == 1:
        outs = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--seeded", type=int, default=25, help="prompts also decoded seeded at batch 1 per method")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--fixed-k", type=int, default=None,
                        help="speculate a fixed K (default: adaptive, which drafts only what pays)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    cells = result.setdefault("cells", {})
    refs = result.setdefault("references", {})

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    max_len = args.max_prompt_tokens + args.max_tokens + 16
    plain = engine("plain", 1, max_len)
    prompts = heldout_prompts(plain.tokenizer, args.prompts, args.max_prompt_tokens)
    result["configuration"] = {"quantization": plain.quantization, "dtype": str(plain.target.dtype),
                               "torch": torch.__version__}
    for kind, seeded in (("greedy", False), ("seeded", True)):
        if len(refs.get(kind, [])) < len(prompts):
            params = [params_for(i, seeded, args.max_tokens) for i in range(len(prompts))]
            answers = []
            for p, sp in tqdm(list(zip(prompts, params)), desc=f"plain references ({kind})"):
                answers += decode(plain, [p], [sp], 1)[0]
            refs[kind] = answers
            save()
    del plain
    methods = args.methods.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    plan = [(m, 1, "greedy") for m in methods if m != "plain"]
    plan += [(m, b, "mixed") for b in batches if b > 1 for m in methods]
    plan += [(m, 1, "seeded") for m in methods if m != "plain"]
    for method, batch, kind in plan:
        name = f"{method}/batch{batch}/{kind}"
        if name in cells:
            continue
        if kind == "greedy":
            chosen = list(range(len(prompts)))
        elif kind == "seeded":
            chosen = list(range(min(args.seeded, len(prompts))))
        else:
            chosen = list(range(len(prompts)))
        seeded = [kind == "seeded" or (kind == "mixed" and i % 2 == 1) for i in chosen]
        params = [params_for(i, s, args.max_tokens) for i, s in zip(chosen, seeded)]
        llm = engine(method, batch, max_len, args.fixed_k)
        print(f"{name}: {len(chosen)} prompts", file=sys.stderr, flush=True)
        if batch == 1:
            answers, seconds = [], 0.0
            for i, sp in tqdm(list(zip(chosen, params)), desc=name):
                out, s = decode(llm, [prompts[i]], [sp], 1)
                answers += out
                seconds += s
        else:
            answers, seconds = decode(llm, [prompts[i] for i in chosen], params, batch)
        mismatches = []
        for i, s, answer in zip(chosen, seeded, answers):
            reference = refs["seeded" if s else "greedy"][i]
            at = first_difference(answer, reference)
            if at is not None:
                mismatches.append({"prompt": i, "seeded": s, "first_difference": at})
        stats = llm.total_stats
        cells[name] = {"requests": len(chosen), "identical": len(chosen) - len(mismatches), "mismatches": mismatches,
                       "tokens": sum(map(len, answers)), "seconds": seconds,
                       "tokens_per_pass": stats.mean_accepted_len, "draft_tokens": stats.draft_tokens,
                       "accepted_tokens": stats.accepted_tokens}
        print(f"{name}: {cells[name]['identical']}/{len(chosen)} identical", file=sys.stderr, flush=True)
        save()
        del llm
        gc.collect()
    rows = [f"| {n} | {c['identical']}/{c['requests']} | {c['tokens_per_pass']:.2f} |" for n, c in cells.items()]
    print("| cell | identical to plain at batch 1 | tokens per pass |\n|---|---:|---:|\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
