# Record: how chunked_prefill.json here (docs/serving.md) was made: python docs/bench/chunked_prefill/chunked_prefill.py --streams 4 --stream-tokens 300 --long-tokens 4000 --repeats 1 --out docs/bench/chunked_prefill
"""Chunked prefill on SmolLM2: the time between tokens of streams that are decoding while a long prompt arrives, with
chunked prefill on and off (the serving engine, AsyncEngine, without HTTP).

--streams requests decode --stream-tokens tokens each (greedy, end of sequence ignored); once every stream has
produced --warmup tokens, a --long-tokens prompt arrives. Reported per setting: the streams' inter-token latency
p50 / p99 / max over the whole run, and the long prompt's time to first token. The settings alternate run by run.

    python docs/bench/chunked_prefill/chunked_prefill.py --out docs/bench/chunked_prefill
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.async_engine import AsyncEngine


async def one_run(engine: AsyncEngine, long_prompt: list[int], args) -> dict:
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    started = asyncio.Event()

    async def stream(i: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=args.stream_tokens, ignore_eos=True)
        async for delta in engine.add_request(f"Write a long story about the number {i}.", params):
            now = time.perf_counter()
            stamps[i].extend([now] * len(delta.token_ids))
            if all(len(s) >= args.warmup for s in stamps):
                started.set()

    async def long_request() -> tuple[float, float]:
        await started.wait()
        sent = time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        first = None
        async for delta in engine.add_request(long_prompt, params):
            if first is None and delta.token_ids:
                first = time.perf_counter()
        return sent, first

    results = await asyncio.gather(*(stream(i) for i in range(args.streams)), long_request())
    sent, first = results[-1]
    gaps = np.concatenate([np.diff(np.array(s)) for s in stamps])
    gaps = gaps[gaps > 0]  # tokens of one delta arrive together (none here: plain decoding)
    return {"itl_p50": float(np.percentile(gaps, 50)), "itl_p99": float(np.percentile(gaps, 99)),
            "itl_max": float(gaps.max()), "long_ttft": first - sent,
            "p99_over_p50": float(np.percentile(gaps, 99) / np.percentile(gaps, 50))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llms = {on: LLM(max_num_seqs=args.streams + 1, max_model_len=args.long_tokens + 512,
                    enable_chunked_prefill=on, enable_prefix_caching=False) for on in (True, False)}
    text = " ".join(f"Item {i}: a short note about inventory, shelving and the weather." for i in range(2000))
    long_prompt = llms[True].tokenizer.encode(text)[:args.long_tokens]
    results = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": {}}
    for repeat in range(args.repeats):
        for on in (True, False) if repeat % 2 == 0 else (False, True):
            engine = AsyncEngine(llms[on])
            engine.start()
            try:
                run = asyncio.run(one_run(engine, long_prompt, args))
            finally:
                engine.shutdown()
            label = "chunked" if on else "one piece"
            print(f"{label}: ITL p50 {run['itl_p50'] * 1e3:.1f} ms, p99 {run['itl_p99'] * 1e3:.1f} ms "
                  f"(x{run['p99_over_p50']:.2f}), max {run['itl_max']:.2f} s; long prompt's first token after "
                  f"{run['long_ttft']:.1f} s", file=sys.stderr, flush=True)
            results["runs"].setdefault(label, []).append(run)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chunked_prefill.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
