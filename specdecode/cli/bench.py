"""`specdecode bench`: plain decoding, every speculative method and transformers' generate() side by side on
held-out ShareGPT by category; writes results.json, report.md and PNG plots. `specdecode bench serve`: see
specdecode.bench.serve_run."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specdecode.cli.types import (MAX_NUM_SEQS, PORT, POSITIVE, SECONDS, SEED, SPECULATIVE_TOKENS, TEMPERATURE,
                                  THREADS, TOKENS, float_range, int_list, int_range)
from specdecode.catalog.registry import DEFAULT_MODEL, SMALL_MODEL
from specdecode.errors import CheckpointError, ConfigError


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _speculator(text: str) -> tuple[str, str]:
    method, sep, path = text.partition("=")
    if not sep or not method or not path:
        raise argparse.ArgumentTypeError(f"expected METHOD=DIR, got {text!r}")
    return method, path


def register(sub) -> None:
    from specdecode.bench.categories import CATEGORIES  # light: the torch-loading modules wait for cmd_bench

    p = sub.add_parser("bench", help="benchmark plain vs speculative decoding vs transformers on real work",
                       description="Run held-out ShareGPT prompts by category (multi-turn chat, code, summarisation, "
                                   "QA, math) through plain decoding, every speculative method and transformers' "
                                   "generate() (plain, assisted, prompt lookup) in one run, at T=0 and T=1; then a "
                                   "batch-size sweep (plain vs fixed K vs adaptive) and a roofline. Writes "
                                   "results.json, report.md and PNG plots to --out. `specdecode bench serve` "
                                   "load-tests OpenAI-compatible servers instead.")
    p.add_argument("--quick", action="store_true",
                   help="a run of a few minutes: 1 prompt per category x 24 tokens at T=0, sweep at batch 1 and 8 with "
                        "K in {2,4}, 16 tokens, 1 repeat (explicit flags still win)")
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="output folder (default bench_results)")
    p.add_argument("--model", default=SMALL_MODEL,
                   help=f"target: a model name, .gguf file or checkpoint directory (default: {SMALL_MODEL}, whose "
                        "figures docs/benchmarks.md records)")
    p.add_argument("--speculative-model", type=Path, default=None,
                   help="draft checkpoint of the draft_model method and of transformers' assisted generation "
                        "(default: the one shipped for a named model)")
    p.add_argument("--speculator", type=_speculator, action="append", default=[], metavar="METHOD=DIR",
                   help="speculator directory of a method (eagle/medusa heads, rest datastore); repeatable")
    p.add_argument("--workload-file", type=Path, default=None,
                   help='JSON {"categories": {name: [{"messages": [...]}, ...]}} instead of held-out ShareGPT')
    p.add_argument("--stdlib-workloads", action="store_true",
                   help="instead: the code workloads from held-out standard-library files as raw prompts (completion, "
                        "grounded_edit, docstring), for models without a chat template")
    p.add_argument("--categories", default=",".join(CATEGORIES), help=f"comma-separated, from {', '.join(CATEGORIES)}")
    p.add_argument("--methods", default=None,
                   help="comma-separated speculative methods (default: all this model has speculators for: "
                        "draft_model, eagle, medusa, ngram, lookahead, rest)")
    p.add_argument("--prompts", type=POSITIVE, default=None, help="prompts per category (default 8)")
    p.add_argument("--max-tokens", type=TOKENS, default=None, help="most tokens per request (default 128)")
    p.add_argument("--max-prompt-tokens", type=POSITIVE, default=None, help="skip longer prompts (default 768)")
    p.add_argument("--temperatures", type=_floats, default=None, help="per-request tables (default 0,1)")
    p.add_argument("--num-speculative-tokens", type=SPECULATIVE_TOKENS, default=None,
                   help="K of every method (default: its own)")
    p.add_argument("--batch-sizes", type=int_list, default=None, help="batch sweep sizes (default 1,2,4,8,16,32,64)")
    p.add_argument("--sweep-ks", type=int_list, default=None, help="fixed K of the batch sweep (default 1,2,3,4,5)")
    p.add_argument("--sweep-method", default=None, help="speculative method of the batch sweep (default ngram)")
    p.add_argument("--sweep-max-tokens", type=TOKENS, default=None, help="tokens per sweep request (default 64)")
    p.add_argument("--sweep-repeats", type=int_range(1, 100), default=None,
                   help="runs per sweep point, fastest counts (default 3)")
    p.add_argument("--no-sweep", action="store_true", help="skip the batch-size sweep")
    p.add_argument("--no-peers", action="store_true", help="skip transformers")
    p.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                   help="the methods always draft K (default: K per step, adaptive)")
    p.add_argument("--fixed-too", action="store_true",
                   help="also run every method at its fixed K, next to its adaptive row")
    p.add_argument("--threads", type=THREADS, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="float32 (default: greedy outputs of every engine are then identical), bfloat16 or float16")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--note", default="", help="free text for the report, e.g. what else ran on the machine")
    p.add_argument("--speed", action="store_true",
                   help="instead: plain decode tokens/s per dtype and linear backend (and int8) against transformers "
                        "and the memory roofline, the cost of a pass over K = 1..16 tokens, batch-8 throughput; "
                        "writes speed.md, speed.json, speed.png (one thread unless --threads)")
    p.add_argument("--llama-cpp", type=Path, default=None, metavar="BIN_DIR",
                   help="with --speed: also llama.cpp (a bin directory built by scripts/build_llama_cpp.sh), plain "
                        "on the same GGUF and a Q8_0 copy, and prompt lookup, against our plain and default "
                        "speculation, prompt by prompt on held-out chat prompts (--prompts per category, default 2)")
    p.add_argument("--backends", type=lambda text: tuple(text.split(",")), default=None,
                   help="with --speed: comma-separated linear backends to time, from gguf, onednn, plain, int8 "
                        "(default: all; gguf alone skips the dequantised float copies, which a 1.5B holds in 7 GB)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="with --speed: wall (default) or cpu, the thread's CPU time (for a machine shared with "
                        "other jobs)")
    p.set_defaults(func=cmd_bench)
    tools = p.add_subparsers(dest="bench_command", metavar="serve|soak|fuzz|code|perplexity|assistant|fim|long|peer-tests")
    register_serve(tools)
    register_soak(tools)
    register_fuzz(tools)
    register_code(tools)
    register_perplexity(tools)
    register_assistant(tools)
    register_fim(tools)
    register_sessions(tools)
    register_long(tools)
    register_peer_tests(tools)


def _checkpoints(args) -> tuple[Path, Path | None]:
    """(target, draft): --model (a name, .gguf or directory; default the default named model, fetched on first
    use) and --speculative-model."""
    from specdecode.catalog.registry import resolve_model

    # the draft as the target: a catalog name (fetched on first use), a .gguf or a checkpoint directory
    draft = None
    if args.speculative_model is not None:
        try:
            draft = Path(resolve_model(args.speculative_model))
        except CheckpointError as error:
            raise CheckpointError(str(error).replace("--model", "--speculative-model", 1)) from None
    return resolve_model(args.model), draft


def peers_installed() -> bool:
    """Whether transformers (the peers' engine) can be imported; if not, say once how to get it."""
    import importlib.util

    missing = [name for name in ("transformers", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"specdecode bench: {' and '.join(missing)} not installed, so the transformers peers are skipped "
              "(pip install -e '.[peers]' adds them; --no-peers silences this)", file=sys.stderr, flush=True)
    return not missing


def cmd_bench(args) -> int:
    import shlex

    import torch

    from specdecode.bench.bench import BenchConfig, run_bench
    from specdecode.bench.report import write_report

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not args.no_peers and not peers_installed():
        args.no_peers = True
    if args.speed:
        return cmd_speed(args)
    if args.llama_cpp is not None:
        raise ConfigError("--llama-cpp is part of the speed benchmark: add --speed")
    _, draft = _checkpoints(args)  # fails early on a missing target or draft
    speculators = dict(args.speculator)
    if draft is not None:
        speculators["draft_model"] = str(draft)
    chosen = {"prompts": args.prompts, "max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens,
              "temperatures": args.temperatures, "num_speculative_tokens": args.num_speculative_tokens,
              "sweep_batch_sizes": args.batch_sizes, "sweep_ks": args.sweep_ks, "sweep_method": args.sweep_method,
              "sweep_max_tokens": args.sweep_max_tokens, "sweep_repeats": args.sweep_repeats}
    if args.methods is not None:
        chosen["methods"] = tuple(m for m in args.methods.split(",") if m)
    chosen = {k: v for k, v in chosen.items() if v is not None}
    if args.no_sweep:
        chosen["sweep_batch_sizes"] = ()
    settings = dict(model=args.model, speculators=speculators, out=args.out, dtype=args.dtype, device=args.device,
                    workload_file=args.workload_file, stdlib_workloads=args.stdlib_workloads,
                    categories=tuple(c for c in args.categories.split(",") if c),
                    peers=not args.no_peers, note=args.note, adaptive=args.adaptive, fixed_too=args.fixed_too,
                    command=shlex.join(["specdecode", *sys.argv[1:]]) if sys.argv[0].endswith("specdecode") else "",
                    **chosen)
    config = BenchConfig.quick(**settings) if args.quick else BenchConfig(**settings)
    paths = write_report(run_bench(config), config.out)
    print(paths["report"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def cmd_speed(args) -> int:
    import torch

    from specdecode.bench.speed import SpeedConfig, run_speed
    from specdecode.bench.speed_report import write_speed_report

    if args.threads is None:
        torch.set_num_threads(1)  # the measurements are one-thread
    target, _ = _checkpoints(args)
    config = SpeedConfig(model=target, tokens=args.max_tokens or (48 if args.quick else 128),
                         rounds=1 if args.quick else 3, max_verify=8 if args.quick else 16,
                         peers=not args.no_peers, device=args.device or "cpu", clock=args.clock,
                         speculation=not args.quick, llama_cpp=args.llama_cpp,
                         peer_prompts=args.prompts or (1 if args.quick else 2),
                         **({"backends": args.backends} if args.backends else {}))
    paths = write_speed_report(run_speed(config), args.out)
    print(paths["report"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


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
    p.add_argument("--model", default=SMALL_MODEL, help="our servers' --model, and the tokenizer that sizes max_tokens "
                                                 "(default smollm2-135m-instruct, whose figures docs/benchmarks.md "
                                                 "records; qwen2.5-coder-1.5b-instruct for the default model)")
    p.add_argument("--modes", default="off,fixed,adaptive", help="our servers: comma-separated off, fixed, adaptive")
    p.add_argument("--speculative-method", default="ngram", help="method of the fixed and adaptive servers")
    p.add_argument("--num-speculative-tokens", type=SPECULATIVE_TOKENS, default=5,
                   help="K of the fixed server (adaptive: the most)")
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
    mix = p.add_argument_group("a code assistant's mix (bench/mix.py): closed loops of short questions and long files")
    mix.add_argument("--mix", choices=("assistant",), default=None,
                     help="run the mix instead of ShareGPT: --streams loops of the coding questions we ship and "
                          "--long-streams loops of --long-tokens-token standard-library files, --max-seconds per "
                          "target; per class TTFT and chunk-gap percentiles, tokens/s and one plot of every target")
    mix.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                     help="with --mix: a server to measure, named (repeat it: ours and each peer on one figure; "
                          "default --base-url, else our own server started with --model)")
    mix.add_argument("--streams", type=POSITIVE, default=6, help="with --mix: short-request loops (default 6)")
    mix.add_argument("--long-streams", type=POSITIVE, default=1, help="with --mix: long-request loops (default 1)")
    mix.add_argument("--long-tokens", type=POSITIVE, default=4096, help="with --mix: a long prompt's file tokens "
                                                                        "(default 4096)")
    mix.add_argument("--long-max-tokens", type=TOKENS, default=64, help="with --mix: a long request's max_tokens "
                                                                         "(default 64)")
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args) -> int:
    from specdecode.bench.serve_run import cmd_bench_serve as run

    return run(args)


def register_soak(sub) -> None:
    p = sub.add_parser("soak", help="soak `specdecode serve`: many clients for a bounded time, checked",
                       description="Start `specdecode serve` (float32), run --clients concurrent clients for "
                                   "--duration seconds (streaming or not, greedy or sampled, completions and chat, "
                                   "random disconnects and cancellations), then check: no 5xx, every greedy answer "
                                   "equal to offline generation, memory back near where it started, gauges at 0.")
    p.add_argument("--clients", type=POSITIVE, default=64, help="concurrent clients (default 64)")
    p.add_argument("--duration", type=SECONDS, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--warmup", type=float_range(0.0), default=30.0, help="seconds before memory is measured")
    p.add_argument("--model", default=SMALL_MODEL,
                   help=f"default: {SMALL_MODEL}, whose soak docs/exactness.md records")
    p.add_argument("--speculative-method", default=None, help="the server's --speculative-method")
    p.add_argument("--speculative-model", default=None, help="the server's --speculative-model")
    p.add_argument("--max-num-seqs", type=MAX_NUM_SEQS, default=32, help="the server's --max-num-seqs")
    p.add_argument("--max-model-len", type=int_range(2), default=512,
                   help="the server's and the offline reference's --max-model-len (default 512)")
    p.add_argument("--num-kv-blocks", type=int_range(1), default=None,
                   help="the server's --num-kv-blocks (default: its plan's): a pool too small for the load preempts")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--json", default=None, help="write the report here")
    p.set_defaults(func=_run("specdecode.bench.soak", "cmd_soak"))


def register_fuzz(sub) -> None:
    p = sub.add_parser("fuzz", help="fuzz the HTTP API from its OpenAPI schema (schemathesis; the [dev] extra)",
                       description="Requests that follow /openapi.json and requests that break it, for every "
                                   "operation; checks no 5xx, OpenAI-format 4xx, schema-conformant answers, and that "
                                   "the server still answers afterwards.")
    p.add_argument("--url", default=None, help="fuzz this running server (default: start one)")
    p.add_argument("--model", default=SMALL_MODEL,
                   help="model of the server started here (default: SmolLM2: the fuzzer checks the HTTP surface, not "
                        "the model, and a 135M model answers its thousands of requests fastest)")
    p.add_argument("--speculative-model", default=None, help="draft of the server started here")
    p.add_argument("--port", type=PORT, default=None)
    p.add_argument("--max-model-len", type=int_range(2), default=96,
                   help="context of the server started here (small, so generations are short)")
    p.add_argument("--requests", type=POSITIVE, default=2000, help="at least this many requests")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--workers", type=int_range(1, 256), default=8)
    p.add_argument("--json", default=None, help="write the report here")
    p.set_defaults(func=_run("specdecode.bench.fuzz", "cmd_fuzz", needs="schemathesis"))


def register_code(sub) -> None:
    p = sub.add_parser("code", help="greedy pass rate on small coding problems, ours vs llama.cpp on the same GGUF",
                       description="Answer each small Python problem of specdecode/bench/workloads/"
                                   "code_problems.json greedily (one chat message each, plain decoding), run the "
                                   "answer's code against the problem's asserts in a sandboxed subprocess, and "
                                   "with --llama-cpp do the same through llama.cpp on the same GGUF file; writes "
                                   "results.json and report.md (per problem verdicts, both pass rates, how many "
                                   "problems differ) to --out.")
    p.add_argument("--model", required=True, help="a model name, .gguf file or checkpoint directory")
    p.add_argument("--llama-cpp", type=Path, default=None, metavar="BIN_DIR",
                   help="also llama.cpp (a bin directory built by scripts/build_llama_cpp.sh) on the same GGUF")
    p.add_argument("--threads", type=THREADS, default=1, help="threads of each engine (default 1)")
    p.add_argument("--limit", type=POSITIVE, default=None, help="only the first N problems (default all 32)")
    p.add_argument("--max-tokens", type=TOKENS, default=512, help="most new tokens per answer (default 512)")
    p.add_argument("--out", type=Path, default=Path("bench_results/code"),
                   help="output folder (default bench_results/code)")
    p.set_defaults(func=_run("specdecode.bench.code_eval", "cmd_bench_code"))


def _pair_args(p, target_help: str, draft_help: str | None) -> None:
    """--model, --draft (unless draft_help is None) and --llama-cpp of the workloads that race the Qwen pair (or its
    target alone) against llama.cpp."""
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct",
                   help=f"{target_help} (default qwen2.5-coder-1.5b-instruct)")
    if draft_help is not None:
        p.add_argument("--draft", default=None, help=f"{draft_help} (default: the target's catalog draft)")
    p.add_argument("--llama-cpp", type=Path, default=None, metavar="BIN_DIR",
                   help="also llama.cpp (a bin directory built by scripts/build_llama_cpp.sh) on the same files")


def register_assistant(sub) -> None:
    p = sub.add_parser("assistant", help="a code-assistant workload: ours (plain, draft, lookup, auto) vs llama.cpp "
                                         "(plain, llama-speculative, llama-lookup) on the same GGUF pair",
                       description="Write small functions (their tests run on every answer), edit held-out "
                                   "standard-library functions, refactor one over a three-turn conversation: greedy, "
                                   "each engine stopping at its end-of-turn token, at each thread count. Ours: plain, "
                                   "draft_model, ngram and auto with the draft (adaptive); with --llama-cpp also "
                                   "llama-completion, llama-speculative with the same draft and llama-lookup. Writes "
                                   "results.json, report.md and assistant.png to --out (decode tokens/s by category "
                                   "and as ratios to llama.cpp plain; greedy answers checked against our plain).")
    _pair_args(p, "the target: a model name or .gguf", "the draft model")
    p.add_argument("--threads", type=lambda text: [THREADS(t) for t in text.split(",")], default=[1],
                   help="comma-separated thread counts of every engine (default 1)")
    p.add_argument("--prompts", type=int_range(1, 8), default=2, help="requests per category (default 2)")
    p.add_argument("--max-tokens", type=TOKENS, default=256, help="most new tokens per answer (default 256)")
    p.add_argument("--num-speculative-tokens", type=SPECULATIVE_TOKENS, default=8,
                   help="ours and llama-lookup: most draft tokens a step (default 8)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="our dtype (default auto: float32 with the quantized kernels for a GGUF)")
    p.add_argument("--out", type=Path, default=Path("bench_results/assistant"),
                   help="output folder (default bench_results/assistant)")
    p.set_defaults(func=_run("specdecode.bench.assistant", "cmd_bench_assistant"))


def register_fim(sub) -> None:
    p = sub.add_parser("fim", help="fill in the middle of standard-library files: ours (plain, lookup, auto) vs "
                                   "llama.cpp (plain, llama-lookup) on the same prompt tokens",
                       description="Edits in the middle of held-out standard-library modules (a function body "
                                   "removed, a few lines removed, a parameter renamed), in llama.cpp's /infill "
                                   "prompt, greedy, each engine stopping at its end tokens. Ours: plain, ngram and "
                                   "auto with the draft (adaptive); with --llama-cpp also llama-completion and "
                                   "llama-lookup on the same tokens. Writes results.json and report.md to --out "
                                   "(exact-match rate of the middle, decode tokens/s, greedy identical to plain).")
    _pair_args(p, "the target, a model with FIM tokens", "auto's draft model")
    p.add_argument("--edits", type=int_range(1, 12), default=9, help="edits, one per module (default 9)")
    p.add_argument("--max-tokens", type=TOKENS, default=128, help="most tokens of a middle (default 128)")
    p.add_argument("--num-speculative-tokens", type=SPECULATIVE_TOKENS, default=8,
                   help="ours and llama-lookup: most draft tokens a step (default 8)")
    p.add_argument("--threads", type=THREADS, default=1, help="threads of every engine (default 1)")
    p.add_argument("--out", type=Path, default=Path("bench_results/fim"), help="output folder (default "
                                                                                "bench_results/fim)")
    p.set_defaults(func=_run("specdecode.bench.fim", "cmd_bench_fim"))


def register_sessions(sub) -> None:
    p = sub.add_parser("sessions", help="the paged KV cache against a live server: concurrent sessions, a shared "
                                        "system prompt's reuse with speculation on and off",
                       description="Start `specdecode serve` (default flags plus --server-args) and send --sessions "
                                   "concurrent chats of ~--prompt-tokens distinct tokens each, to the paged cache "
                                   "and to the slots layout (--block-size 0): how many run at once (peak of "
                                   "num_requests_running), refused, preemptions. Then --shared requests on one "
                                   "system prompt of that length, with the default speculation and without: the "
                                   "prefix hit rate after the first request, and whether the answers agree. Writes "
                                   "sessions.json, sessions.txt and sessions.png to --out.")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the served model (default {DEFAULT_MODEL})")
    p.add_argument("--sessions", type=int_range(1, 4096), default=24, help="concurrent sessions (default 24)")
    p.add_argument("--prompt-tokens", type=int_range(16), default=1000, help="prompt tokens a session (default 1000)")
    p.add_argument("--max-tokens", type=TOKENS, default=8, help="tokens generated a request (default 8)")
    p.add_argument("--shared", type=int_range(2, 4096), default=16, help="requests on the shared prompt (default 16)")
    p.add_argument("--server-args", default="", help="more `specdecode serve` flags, one string")
    p.add_argument("--out", type=Path, default=None, help="folder for the report")
    p.set_defaults(func=_run("specdecode.bench.sessions", "cmd_sessions"))


def register_long(sub) -> None:
    p = sub.add_parser("long", help="prefill and decode tokens/s against the prompt's length, ours vs llama.cpp",
                       description="For each prompt length: a prompt of that many tokens of standard-library code, "
                                   "then --tokens greedy tokens; ours (no speculation) and, with --llama-cpp, "
                                   "llama-completion on the same text. Writes results.json, README.md and long.png "
                                   "(tokens/s against the prompt's length) to --out.")
    _pair_args(p, "a model name or .gguf", None)
    p.add_argument("--lengths", type=int_list, default=[512, 1024, 2048, 4096, 8192, 16384],
                   help="comma-separated prompt lengths in tokens (default 512,1024,2048,4096,8192,16384)")
    p.add_argument("--tokens", type=TOKENS, default=32, help="greedy tokens after each prompt (default 32)")
    p.add_argument("--threads", type=THREADS, default=1, help="threads of both engines (default 1)")
    p.add_argument("--out", type=Path, default=Path("bench_results/long"), help="output folder (default "
                                                                                 "bench_results/long)")
    p.set_defaults(func=_run("specdecode.bench.long", "cmd_bench_long"))


def register_peer_tests(sub) -> None:
    from specdecode.bench.peer_tests import DEFAULT_MODEL, UNIT_FILES

    p = sub.add_parser("peer-tests", help="llama.cpp's own server test suite against `specdecode serve`",
                       description="Fetch llama.cpp's server tests (tools/server/tests of the pinned llama-cpp-python "
                                   "sdist, checked by sha256), install their requirements (pinned) in a venv of their "
                                   "own, and run their fast tier with a launcher that maps llama-server's flags onto "
                                   "`specdecode serve`; classify every test (passed, model-dependent, deliberate, "
                                   "not-supported, protocol) from specdecode/bench/workloads/peer_tests_classes.json "
                                   "and print the counts per class. Writes results.json, junit.xml, pytest.log.")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the served model (default {DEFAULT_MODEL})")
    p.add_argument("--files", default=None,
                   help=f"comma-separated unit files of the suite (default: {','.join(UNIT_FILES)})")
    p.add_argument("-k", dest="select", default=None, help="only the tests pytest -k selects")
    p.add_argument("--threads", type=THREADS, default=1, help="each server's threads (default 1)")
    p.add_argument("--test-timeout", type=POSITIVE, default=120, help="seconds a test may take (default 120)")
    p.add_argument("--work-dir", type=Path, default=Path("~/.cache/specdecode/peer_tests"),
                   help="where the sdist, the suite and its venv go (default ~/.cache/specdecode/peer_tests)")
    p.add_argument("--out", type=Path, default=Path("bench_results/peer_tests"),
                   help="output folder (default bench_results/peer_tests)")
    p.add_argument("-v", "--verbose", action="store_true", help="list every unclassified or protocol failure")
    p.set_defaults(func=_run("specdecode.bench.peer_tests", "cmd_peer_tests"))


def register_perplexity(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity through the quantized kernels vs the dequantised float32 model",
                       description="Perplexity of a GGUF's model on held-out text (default: CPython standard "
                                   "library sources) through our kernels and through the same weights dequantised "
                                   "to float32; prints both and their relative gap.")
    p.add_argument("--model", required=True, help="a model name or .gguf file")
    p.add_argument("--text", nargs="*", default=None, help="text files to read (default: stdlib sources)")
    p.add_argument("--windows", type=POSITIVE, default=8, help="windows of text (default 8)")
    p.add_argument("--window", type=POSITIVE, default=512, help="tokens per window (default 512)")
    p.add_argument("--threads", type=THREADS, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--kv-cache-dtypes", nargs="+", choices=["float32", "float16", "bfloat16", "q8_0"], default=None,
                   help="compare KV cache dtypes through the kernels instead (the first is the baseline)")
    p.add_argument("--out", type=Path, default=None, help="also write the report as JSON here")
    p.set_defaults(func=_run("specdecode.bench.perplexity", "cmd_bench_perplexity"))


def _run(module: str, name: str, needs: str | None = None):
    """A command function that imports its module only when it runs (and says which extra a missing need is in)."""
    def command(args) -> int:
        import importlib
        import importlib.util

        if needs is not None and importlib.util.find_spec(needs) is None:
            raise ConfigError(f"{needs} is not installed: pip install -e '.[dev]'")
        return getattr(importlib.import_module(module), name)(args)

    return command
