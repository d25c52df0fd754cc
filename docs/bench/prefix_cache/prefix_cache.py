# Record: how prefix_cache.json and its plot here (docs/serving.md) were made: python docs/bench/prefix_cache/prefix_cache.py --turns 10 --answer-tokens 32 --system-tokens 1000 --requests 16 --batch 8 --max-tokens 16 --repeats 1 --out docs/bench/prefix_cache
"""Prefix caching on SmolLM2 (default configuration), on against off in one run:

1. a 10-turn chat replay: a held-out ShareGPT conversation's user turns, each answered by the model (greedy, up to
   --answer-tokens), the history growing; time to first token (the prefill of each turn) per turn;
2. many users, one long system prompt: --requests requests of a --system-tokens system prompt and each its own
   question, --batch at a time; requests per second.

The two settings alternate run by run (--repeats each), so machine load hits both alike. Writes JSON and a plot.

    python docs/bench/prefix_cache/prefix_cache.py --out docs/bench/prefix_cache
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specdecode import LLM, SamplingParams
from specdecode.catalog import sharegpt


def conversation(turns: int) -> list[str]:
    """The user turns of the first held-out ShareGPT conversation with at least `turns` of them (short ones)."""
    _, heldout = sharegpt.split(sharegpt.load_conversations(sharegpt.fetch(quiet=True)))
    for conv in heldout:
        users = [m["content"] for m in conv.messages if m["role"] == "user"]
        users = [u for u in users if 0 < len(u) < 400]
        if len(users) >= turns:
            return users[:turns]
    raise SystemExit(f"no held-out conversation has {turns} short user turns")


def first_token_seconds(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], str]:
    """(seconds to the first token: the prefill, the answer's token ids, its text)."""
    seq = llm.make_sequence(prompt, params)
    start = time.perf_counter()
    ttft = None
    for _ in llm._run([seq]):
        if ttft is None:
            ttft = time.perf_counter() - start
    out = seq.output()
    return ttft, out.outputs[0].token_ids, out.outputs[0].text


def chat_replay(llm: LLM, users: list[str], answer_tokens: int) -> dict:
    messages, ttfts, answers = [], [], []
    params = SamplingParams(temperature=0, max_tokens=answer_tokens)
    for user in users:
        messages.append({"role": "user", "content": user})
        prompt = llm.tokenizer.encode_chat(messages)
        ttft, ids, text = first_token_seconds(llm, prompt, params)
        ttfts.append(ttft)
        answers.append(ids)
        messages.append({"role": "assistant", "content": text})
    return {"ttft": ttfts, "prompt_tokens": len(prompt), "answers": answers}


def shared_system(llm: LLM, system_tokens: int, requests: int, max_tokens: int) -> dict:
    system = " ".join(["You are a careful assistant for a hardware store. Answer briefly, cite the aisle, and never "
                       "invent prices."] * 200)
    ids = llm.tokenizer.encode(system)[:system_tokens]
    system = llm.tokenizer.decode(ids)
    prompts = [llm.tokenizer.encode_chat([{"role": "system", "content": system},
                                          {"role": "user", "content": f"Where do I find item number {i}?"}])
               for i in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "requests_per_s": requests / seconds,
            "answers": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    users = conversation(args.turns)
    engines = {on: LLM(max_num_seqs=args.batch, max_model_len=4096, enable_prefix_caching=on) for on in (True, False)}
    results = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "configuration": {"quantization": engines[True].quantization}, "chat": {}, "system": {}}
    for repeat in range(args.repeats):
        for on in (True, False) if repeat % 2 == 0 else (False, True):
            label = "on" if on else "off"
            llm = engines[on]
            llm.runner.slots.forget()  # each run starts cold
            chat = chat_replay(llm, users, args.answer_tokens)
            print(f"chat, prefix caching {label}: ttft turn 1 {chat['ttft'][0]:.2f} s, turn {args.turns} "
                  f"{chat['ttft'][-1]:.2f} s ({chat['prompt_tokens']} prompt tokens)", file=sys.stderr, flush=True)
            llm.runner.slots.forget()
            system = shared_system(llm, args.system_tokens, args.requests, args.max_tokens)
            print(f"system prompt, prefix caching {label}: {system['requests_per_s']:.3f} requests/s",
                  file=sys.stderr, flush=True)
            results["chat"].setdefault(label, []).append(chat)
            results["system"].setdefault(label, []).append(system)
    on_chat, off_chat = results["chat"]["on"], results["chat"]["off"]
    median = lambda runs, i: statistics.median(r["ttft"][i] for r in runs)  # noqa: E731
    summary = {
        "chat_ttft_turn_last_over_first_on": median(on_chat, -1) / median(on_chat, 0),
        "chat_ttft_turn_last_over_first_off": median(off_chat, -1) / median(off_chat, 0),
        "chat_answers_identical": all(r["answers"] == on_chat[0]["answers"] for r in on_chat + off_chat),
        "system_throughput_ratio": statistics.median(r["requests_per_s"] for r in results["system"]["on"])
        / statistics.median(r["requests_per_s"] for r in results["system"]["off"]),
        "system_answers_identical": all(r["answers"] == results["system"]["on"][0]["answers"]
                                        for r in results["system"]["on"] + results["system"]["off"]),
    }
    results["summary"] = summary
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_cache.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    turns = range(1, args.turns + 1)
    for label, runs in (("prefix caching on", on_chat), ("off", off_chat)):
        ax.plot(turns, [median(runs, i) for i in range(args.turns)], marker="o", label=label)
    ax.set_xlabel("chat turn")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("SmolLM2, 10-turn chat replay (median of runs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "prefix_cache_ttft.png", dpi=120)


if __name__ == "__main__":
    main()
