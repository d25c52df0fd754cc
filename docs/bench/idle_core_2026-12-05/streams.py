# Record: how the two-core figures of docs/bench/idle_core_2026-12-05/README.md were made.
"""Issue 48 item 3, measured on whole models before building: the 1.5B's one-token step and a draft level of the
0.5B (as specdecode loads it beside the 1.5B: lightened to Q4_0, its head cut to the ranked 32,768 tokens) and
a pass of the 1.5B over 5 tokens (a chain of 4 verified), each
with 1 and 2 torch threads, and each at one thread while another process keeps the other core busy with the other
model's steps (what drafting on the idle core would do). Rounds interleave every case; wall clock; median.

    python docs/bench/idle_core_2026-12-05/streams.py --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from specdecode.catalog.registry import model_path
from specdecode.model.loading import load_model

CONTEXT = 300


def load(name: str):
    """(model, cache holding CONTEXT tokens) for 'target' or 'draft', loaded as the engine loads them."""
    from specdecode.model.quant import lighten
    from specdecode.model.tokenizer import Tokenizer
    from specdecode.speculation.proposers.draft_model import DRAFT_VOCAB, draft_head, frequent_tokens

    if name == "target":
        model = load_model(model_path("qwen2.5-coder-1.5b-instruct"), dtype="float32", quantization="gguf")
    else:
        path = model_path("qwen2.5-coder-0.5b-instruct")
        model = load_model(path, dtype="float32", quantization="gguf")
        tokenizer = Tokenizer(path, model.config.eos_token_ids)
        model.lm_head = draft_head(model.lm_head, frequent_tokens(tokenizer, model.config.vocab_size, DRAFT_VOCAB))
        lighten(model)
    cache = model.make_cache(1, CONTEXT + 8)
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, CONTEXT), generator=torch.Generator().manual_seed(0)), cache=cache)
    cache.advance(torch.tensor([0]), CONTEXT)
    return model, cache


def step_ms(model, cache, calls: int = 5, width: int = 1) -> float:
    """Milliseconds of a cached forward of `width` new tokens (1: a step or a draft level; 5: a pass verifying 4)."""
    token = torch.tensor([[42] * width])
    with torch.inference_mode():
        model(token, cache=cache)
        start = time.perf_counter()
        for _ in range(calls):
            model(token, cache=cache)
    return 1000 * (time.perf_counter() - start) / calls


def loop(name: str) -> None:
    """Keep one core busy with `name`'s one-token steps until killed (the other stream)."""
    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    model, cache = load(name)
    print("ready", flush=True)
    while True:
        step_ms(model, cache, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop", choices=("target", "draft"))
    args = parser.parse_args()
    if args.loop:
        return loop(args.loop)
    models = {name: load(name) for name in ("target", "draft")}
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        os.sched_setaffinity(0, {0, 1})
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, (model, cache) in models.items():
                times.setdefault(f"{name} alone, {threads} thread(s)", []).append(step_ms(model, cache))
            model, cache = models["target"]
            times.setdefault(f"target 5-token pass alone, {threads} thread(s)", []).append(
                step_ms(model, cache, width=5))
        os.sched_setaffinity(0, {0})
        torch.set_num_threads(1)
        for name, other in (("target", "draft"), ("draft", "target")):
            busy = subprocess.Popen([sys.executable, __file__, "--loop", other], stdout=subprocess.PIPE, text=True)
            busy.stdout.readline()  # loaded and stepping
            time.sleep(0.5)
            model, cache = models[name]
            times.setdefault(f"{name}, 1 thread, other core stepping the {other}", []).append(step_ms(model, cache))
            if name == "target":
                times.setdefault("target 5-token pass, 1 thread, other core stepping the draft", []).append(
                    step_ms(model, cache, width=5))
            busy.kill()
            busy.wait()
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    out = {"cpu": next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
           "ms_median": {k: round(statistics.median(v), 2) for k, v in times.items()},
           "ms_min": {k: round(min(v), 2) for k, v in times.items()},
           "rounds": args.rounds, "command": "python " + " ".join(sys.argv)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
