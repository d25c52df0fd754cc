# Record: how the JSON files here (docs/serving.md) were made: python docs/bench/structured/structured.py --prompts 100 --k 4 --workload extract --out docs/bench/structured/structured.json
"""Structured output on the real model: schema-valid JSON on a JSON-extraction workload, plain vs speculative
(interleaved, one thread), and the grammar mask's share of a step.

    python docs/bench/structured/structured.py --prompts 100 --k 4 --workload extract|reformat --out docs/bench/structured/W.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams
from specdecode.speculation import grammar as grammar_module

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"},
    "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "city", "age", "skills"], "additionalProperties": False}
PEOPLE = [("Alice", "Paris", 34, "Python and cooking"), ("Bob", "Lagos", 27, "welding"), ("Chen", "Taipei", 45,
          "accounting, chess and tennis"), ("Dana", "Austin", 19, "guitar"), ("Emeka", "Abuja", 52, "surgery"),
          ("Fatima", "Casablanca", 38, "law and Arabic poetry"), ("Goran", "Zagreb", 61, "sailing"),
          ("Hana", "Kyoto", 23, "pottery and Go"), ("Ivan", "Kazan", 30, "physics"), ("Julia", "Lima", 41,
          "marketing and salsa")]


def prompts(n: int, workload: str = "extract") -> list[list[dict]]:
    """extract: a sentence about a person -> the schema's JSON. reformat: the person as a JSON record with two
    more fields -> the schema's JSON without them (the values follow their keys in the prompt, as in an agent's
    tool output rewritten for the next call)."""
    out = []
    for i in range(n):
        name, city, age, skills = PEOPLE[i % len(PEOPLE)]
        age += i // len(PEOPLE)
        if workload == "extract":
            text = f"{name} is {age} years old, lives in {city} and is good at {skills}."
            content = f"Extract the person as JSON with name, city, age and skills.\n{text}"
        else:
            record = json.dumps({"id": 1000 + i, "name": name, "city": city, "age": age,
                                 "skills": skills.replace(", ", " and ").split(" and "), "joined": 2000 + i % 25})
            content = f"Return this record without its id and joined fields, as JSON:\n{record}"
        out.append([{"role": "user", "content": content}])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--workload", choices=("extract", "reformat"), default="extract")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--method", default="ngram")
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens (also caps a forced run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured={"json_schema": SCHEMA})
    plain = LLM(max_num_seqs=1)
    spec = LLM(max_num_seqs=1, speculative_config={"method": args.method, "num_speculative_tokens": args.k,
                                                   "adaptive": False})
    mask_time = [0.0]
    real = grammar_module.Grammar.tree_masks

    def timed(self, paths):
        t = time.perf_counter()
        try:
            return real(self, paths)
        finally:
            mask_time[0] += time.perf_counter() - t
    grammar_module.Grammar.tree_masks = timed
    rows, totals = [], {"plain": 0.0, "spec": 0.0}
    for i, conv in enumerate(prompts(args.prompts, args.workload)):
        result = {}
        for name, llm in (("plain", plain), ("spec", spec)) if i % 2 == 0 else (("spec", spec), ("plain", plain)):
            mask_time[0] = 0.0
            t = time.perf_counter()
            out = llm.chat(conv, params)[0].outputs[0]
            dt = time.perf_counter() - t
            totals[name] += dt
            try:
                data = json.loads(out.text)
                valid = set(data) == set(SCHEMA["required"]) and isinstance(data["age"], int)
            except json.JSONDecodeError:
                valid = False
            result[name] = {"seconds": dt, "tokens": len(out.token_ids), "valid": valid, "text": out.text,
                            "finish": out.finish_reason, "mask_share": mask_time[0] / dt}
        result["identical"] = result["plain"]["text"] == result["spec"]["text"]
        rows.append(result)
        print(f"{i}: valid {result['plain']['valid']}/{result['spec']['valid']} identical {result['identical']} "
              f"speedup {result['plain']['seconds'] / result['spec']['seconds']:.2f}x "
              f"mask {result['plain']['mask_share']:.1%} {result['spec']['text'][:70]}", flush=True)
    summary = {"prompts": len(rows), "valid_plain": sum(r["plain"]["valid"] for r in rows),
               "valid_spec": sum(r["spec"]["valid"] for r in rows), "identical": sum(r["identical"] for r in rows),
               "speedup": totals["plain"] / totals["spec"], "workload": args.workload, "method": args.method, "k": args.k,
               "mask_share_plain": sum(r["plain"]["mask_share"] * r["plain"]["seconds"] for r in rows) / totals["plain"],
               "tokens_per_pass_spec": spec.total_stats.emitted_tokens / max(1, spec.total_stats.steps)}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
