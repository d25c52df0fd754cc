"""`specdecode bench serve`: the serving benchmark. Against servers it starts itself (speculation off / fixed K /
adaptive, `specdecode serve` subprocesses, all up at once and taking turns at each load, so machine noise hits
them alike) or against any OpenAI-compatible --base-url. Writes serve_results.json, serve_report.md, serve.png."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from specdecode.errors import ConfigError


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
    from specdecode.catalog.registry import resolve_model
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


def run_mix_bench(args, log=lambda s: print(s, file=sys.stderr)) -> dict:
    """`bench serve --mix assistant`: every --target in turn (or --base-url, or our own server), the same requests."""
    from specdecode.bench.mix import long_requests, run_mix, short_requests, summarise_mix
    from specdecode.bench.servers import ManagedServer, ServerSpec
    from specdecode.catalog.registry import resolve_model
    from specdecode.hardware import cpu_name
    from specdecode.model.tokenizer import Tokenizer

    targets = {}
    for item in args.target:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith("http"):
            raise ConfigError(f"--target takes NAME=URL (e.g. ours=http://127.0.0.1:8000), got {item!r}")
        targets[name] = url.rstrip("/")
    if not targets and args.base_url:
        targets["server"] = args.base_url.rstrip("/")
    tokenizer = Tokenizer(resolve_model(args.model))
    short = short_requests(args.max_tokens_cap)
    long = long_requests(tokenizer, args.long_tokens, args.long_max_tokens)
    if not long:
        raise ConfigError(f"no held-out standard-library file has {args.long_tokens} tokens: lower --long-tokens")
    results = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                            if k not in ("func", "api_key")}, "cpu": cpu_name(), "runs": {}}
    results["settings"]["long_files"] = [r.source for r in long]
    with ExitStack() as stack:
        if not targets:
            spec = ServerSpec("adaptive", args.model, "auto", args.num_speculative_tokens, args.max_num_seqs,
                              args.long_tokens + 512, threads=args.threads)
            server = stack.enter_context(ManagedServer(spec, args.out))
            log(f"our server ready after {server.wait_ready():.0f} s")
            targets["specdecode"] = server.base_url
        for name, url in targets.items():
            model = args.served_model or _served_model(url, args.api_key)
            outcomes, seconds = asyncio.run(run_mix(url, model, short, long, args.streams, args.long_streams,
                                                    args.max_seconds, args.temperature, args.api_key))
            run = results["runs"][name] = summarise_mix(outcomes, seconds)
            log(f"{name}: {run['output_tokens_per_s']:.1f} tok/s; short: {run['short']['done']} done, TTFT p50/p99 "
                f"{run['short']['p50_ttft_ms'] / 1000:.2f}/{run['short']['p99_ttft_ms'] / 1000:.2f} s, gap p99 "
                f"{run['short']['p99_gap_ms']:.0f} ms; long: {run['long']['done']} done, TTFT p50 "
                f"{run['long']['p50_ttft_ms'] / 1000:.1f} s")
    return results


def cmd_bench_serve(args) -> int:
    from specdecode.bench.serve_report import write_serve_report

    if args.mix:
        from specdecode.bench.mix import write_mix_report

        paths = write_mix_report(run_mix_bench(args), args.out)
        print(paths["report"].read_text())
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0

    paths = write_serve_report(run_serve_bench(args), args.out)
    print(paths["report"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
