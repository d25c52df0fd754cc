# Record: how the copy-task figures of docs/bench/wide_pass_2026-12-05 were made (see README.md there).
"""What users see of a cheap wide pass: a model asked to repeat a long code block it was shown with a light edit
(prompt lookup finds the rest in the prompt). Plain decoding against prompt lookup at a fixed K = 4 and K = 8 and
under the adaptive controller, greedy, one thread, interleaved round by round (the fastest round counts); every
answer checked token for token against plain decoding's.

    python docs/bench/wide_pass_2026-12-05/copy_task.py [--model qwen2.5-coder-1.5b-instruct] [--tokens 320] [--rounds 2]
"""
from __future__ import annotations

import argparse
import inspect
import json
import textwrap

import torch

from specdecode.bench.measure import trace_generate
from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams


def prompt() -> str:
    """A long function from the standard library, to be repeated with one argument renamed."""
    import shutil

    code = textwrap.dedent(inspect.getsource(shutil._copytree))
    return ("Rename the argument `ignore_dangling_symlinks` to `skip_dangling` in this function and return the "
            f"whole function, unchanged otherwise.\n\n```python\n{code}```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--tokens", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ngram = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    configs = {"plain": None,
               "ngram K=4": {**ngram, "num_speculative_tokens": 4, "adaptive": False},
               "ngram K=8": {**ngram, "num_speculative_tokens": 8, "adaptive": False},
               "ngram adaptive": {**ngram, "num_speculative_tokens": 8}}
    llms = {name: LLM(model=args.model, speculative_config=config, threads=1) for name, config in configs.items()}
    tokenizer = llms["plain"].tokenizer
    ids = tokenizer.encode_chat([{"role": "user", "content": prompt()}])
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    best, answers = {}, {}
    for r in range(args.rounds):
        for name, llm in llms.items():
            trace = trace_generate(llm, ids, params)
            rate = (len(trace.token_ids) - 1) / (trace.seconds - trace.ttft)
            answers[name] = trace.token_ids
            if rate > best.get(name, (0,))[0]:
                best[name] = (rate, trace.stats)
            print(f"round {r + 1}: {name} {rate:.2f} tokens/s", flush=True)
    plain = best["plain"][0]
    for name, (rate, stats) in best.items():
        row = {"config": name, "tokens_per_s": round(rate, 2), "x_plain": round(rate / plain, 2),
               "tokens": len(answers[name]), "same_as_plain": answers[name] == answers["plain"],
               "prompt_tokens": len(ids)}
        if stats is not None and stats.draft_tokens:
            row.update(acceptance=round(stats.acceptance_rate, 3),
                       tokens_per_step=round(stats.emitted_tokens / max(1, stats.steps), 2),
                       drafted_per_step=round(stats.draft_tokens / max(1, stats.steps), 2))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
