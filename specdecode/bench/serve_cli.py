"""`specdecode bench serve`: the serving benchmark. Against servers it starts itself (speculation off / fixed K /
adaptive, `specdecode serve` subprocesses, all up at once and taking turns at each load, so machine noise hits
them alike) or against any OpenAI-compatible --base-url. Writes serve_results.json, serve_report.md, serve.png."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from specdecode.argtypes import (MAX_NUM_SEQS, POSITIVE, SECONDS, SEED, SPECULATIVE_TOKENS, TEMPERATURE, THREADS,
                                 TOKENS)
from specdecode.errors import ConfigError


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers (inf allowed), got {text!r}") from None


def register_serve(sub) -> None:
    p = sub.add_parser("serve", help="load-test OpenAI-compatible servers with ShareGPT requests",
                       description="Replay held-out ShareGPT first turns (reference answer length as max_tokens, "
                                   "capped) as streaming chat requests with Poisson arrivals at each --rates value "
                                   "(or --concurrency); report TTFT, TPOT, ITL p50/p90/p99, request and token "
                                   "throughput and goodput under --slo-ttft-ms/--slo-tpot-ms. Without --base-url it "
                                   "starts `specdecode serve` once per --modes entry (off, fixed, adaptive).")
    p.add_argument("--base-url", default=None, help="an OpenAI-compatible server (default: start our own)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token for --base-url")
    p.add_argument("--served-model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--model", default=None, help="our servers' --model, and the tokenizer that sizes max_tokens "
                                                 "(default smollm2-135m-instruct)")
    p.add_argument("--modes", default="off,fixed,adaptive", help="our servers: comma-separated off, fixed, adaptive")
    p.add_argument("--speculative-method", default="ngram", help="method of the fixed and adaptive servers")
    p.add_argument("--num-speculative-tokens", type=SPECULATIVE_TOKENS, default=5, help="K of the fixed server (adaptive: the most)")
    p.add_argument("--max-num-seqs", type=MAX_NUM_SEQS, default=16, help="our servers' --max-num-seqs (default 16)")
    p.add_argument("--rates", type=_floats, default=(1.0,), help="requests/s, Poisson; inf = all at once (default 1)")
    p.add_argument("--concurrency", type=POSITIVE, default=None, help="a closed loop of this many requests instead")
    p.add_argument("--num-requests", type=POSITIVE, default=32, help="requests per server and load (default 32)")
    p.add_argument("--max-seconds", type=SECONDS, default=300.0, help="bound per server and load (default 300)")
    p.add_argument("--max-tokens-cap", type=TOKENS, default=256, help="cap on max_tokens (default 256)")
    p.add_argument("--max-prompt-tokens", type=POSITIVE, default=768, help="skip longer prompts (default 768)")
    p.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    p.add_argument("--slo-ttft-ms", type=SECONDS, default=2000.0, help="goodput SLO on TTFT (default 2000)")
    p.add_argument("--slo-tpot-ms", type=SECONDS, default=100.0, help="goodput SLO on TPOT (default 100)")
    p.add_argument("--threads", type=THREADS, default=1, help="torch threads of each server (default 1)")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the arrival times")
    p.add_argument("--note", default="", help="free text for the report")
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="output folder (default bench_results)")
    p.set_defaults(func=cmd_bench_serve)


def _served_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()["data"]
    if not models:
        raise ConfigError(f"{base_url}/v1/models lists no model; pass --served-model")
    return models[0]["id"]


def run_serve_bench(args, log=lambda s: print(s, file=sys.stderr)) -> dict:
    from specdecode.bench.serve import LoadConfig, run_load, sharegpt_requests, summarise
    from specdecode.bench.servers import ManagedServer, ServerSpec
    from specdecode.models.registry import resolve_model
    from specdecode.model.tokenizer import Tokenizer

    if args.num_requests < 1 or args.max_seconds <= 0 or args.max_tokens_cap < 1:
        raise ConfigError("--num-requests, --max-seconds and --max-tokens-cap must be positive")
    loads = ([LoadConfig(concurrency=args.concurrency, max_seconds=args.max_seconds, temperature=args.temperature)]
             if args.concurrency else
             [LoadConfig(rate=r, max_seconds=args.max_seconds, seed=args.seed, temperature=args.temperature)
              for r in args.rates])
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    requests = sharegpt_requests(tokenizer, args.num_requests, args.max_tokens_cap, args.max_prompt_tokens)
    started = time.perf_counter()
    load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                            if k not in ("func", "api_key")},
               "requests": [{"source": r.source, "max_tokens": r.max_tokens} for r in requests], "runs": []}
    with ExitStack() as stack:
        if args.base_url:
            targets = {"server": (args.base_url.rstrip("/"), None)}
        else:
            targets = {}
            for mode in [m for m in args.modes.split(",") if m]:
                spec = ServerSpec(mode, args.model, args.speculative_method, args.num_speculative_tokens,
                                  args.max_num_seqs, args.max_prompt_tokens + args.max_tokens_cap + 64,
                                  threads=args.threads)
                server = stack.enter_context(ManagedServer(spec, args.out))
                targets[mode] = (server.base_url, server)
            for mode, (_, server) in targets.items():  # started together, waited for in turn
                log(f"{mode} server ready after {server.wait_ready():.0f} s: {' '.join(server.command[3:])}")
            results["servers"] = {m: " ".join(["specdecode", *s.command[3:]]) for m, (_, s) in targets.items()}
        model = args.served_model or _served_model(next(iter(targets.values()))[0], args.api_key)
        warm_up = LoadConfig(concurrency=1, max_seconds=args.max_seconds)
        for url, _ in targets.values():  # first-request costs (allocations, lazy imports) stay out of the figures
            asyncio.run(run_load(url, model, [dataclasses.replace(requests[0], max_tokens=4)], warm_up, args.api_key))
        for load in loads:
            for mode, (url, server) in targets.items():
                cpu = server.cpu_seconds() if server else 0.0
                outcomes, seconds = asyncio.run(run_load(url, model, requests, load, args.api_key))
                row = {"target": mode, "load": load.label, "rate": load.rate, "concurrency": load.concurrency,
                       **summarise(outcomes, seconds, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)}
                if server:
                    row["server_cpu_seconds"] = server.cpu_seconds() - cpu
                    if row["output_tokens"]:
                        row["cpu_s_per_million_tokens"] = 1e6 * row["server_cpu_seconds"] / row["output_tokens"]
                results["runs"].append(row)
                log(f"{mode} @ {load.label}: {row['completed']}/{row['requests']} done, "
                    f"{row['output_token_throughput']:.1f} tok/s, TTFT p50 {row['p50_ttft_ms']:.0f} ms, "
                    f"TPOT p50 {row['p50_tpot_ms']:.1f} ms, goodput {row['goodput']:.2f} req/s")
    results["wall_seconds"] = time.perf_counter() - started
    if load_average is not None:  # other jobs on the machine: the figures' context
        results["load_average"] = [load_average, os.getloadavg()[0]]
    return results


def cmd_bench_serve(args) -> int:
    from specdecode.bench.serve_report import write_serve_report

    paths = write_serve_report(run_serve_bench(args), args.out)
    print(paths["report"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
