"""`specdecode bench`: plain decoding, every speculative method and transformers' generate() side by side on
the shipped workloads; writes results.json, report.md and PNG plots."""
from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.errors import CheckpointError, ConfigError


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def register(sub) -> None:
    from specdecode.bench.workloads import WORKLOADS  # light: the torch-loading modules wait for cmd_bench

    p = sub.add_parser("bench", help="benchmark plain vs speculative decoding vs transformers, write a report",
                       description="Run the shipped workloads (code completion, grounded editing, docstrings) with "
                                   "plain decoding, each speculative method and transformers' generate() (plain, "
                                   "assisted, prompt lookup) in one run; then a batch-size sweep and a roofline. "
                                   "Writes results.json, report.md and PNG plots to --out.")
    p.add_argument("--quick", action="store_true",
                   help="a run of a few minutes: 3 prompts x 48 tokens, sweep with K in {2,4}, 32 tokens, 1 repeat "
                        "(explicit flags still win)")
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="output folder (default bench_results)")
    p.add_argument("--model", default=None,
                   help="target: a model name, .gguf file or checkpoint directory (default: smollm2-135m-instruct)")
    p.add_argument("--speculative-model", type=Path, default=None,
                   help="draft checkpoint (default: none, so only the methods without a draft model run)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--methods", default=None,
                   help="comma-separated speculative methods (default all: draft_chain, draft_tree, ngram, adaptive)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per workload (default 8)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 128)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="K of the draft-model methods (default 4)")
    p.add_argument("--ngram-tokens", type=int, default=None, help="K of n-gram lookup (default 8)")
    p.add_argument("--batch-sizes", type=_ints, default=None, help="batch sweep sizes (default 1,2,4,8,16,32)")
    p.add_argument("--sweep-ks", type=_ints, default=None, help="fixed K of the batch sweep (default 1,2,3,4,5)")
    p.add_argument("--no-sweep", action="store_true", help="skip the batch-size sweep")
    p.add_argument("--no-peers", action="store_true", help="skip transformers")
    p.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                   help="draft_chain, draft_tree and ngram always draft K (default: K per step, adaptive)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--note", default="", help="free text for the report, e.g. what else ran on the machine")
    p.add_argument("--speed", action="store_true",
                   help="instead: plain decode tokens/s per dtype and linear backend (and int8) against transformers "
                        "and the memory roofline, the cost of a pass over K = 1..16 tokens, batch-8 throughput; "
                        "writes speed.md, speed.json, speed.png (one thread unless --threads)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="with --speed: wall (default) or cpu, the thread's CPU time (for a machine shared with "
                        "other jobs)")
    p.set_defaults(func=cmd_bench)


def _checkpoints(args) -> tuple[Path, Path | None]:
    """(target, draft): --model (a name, .gguf or directory; default the default named model, fetched on first
    use) and --speculative-model (none: only the methods that need no draft model run)."""
    from specdecode.models.registry import resolve_model

    draft = args.speculative_model
    if draft is not None and not (Path(draft) / "config.json").is_file():
        raise CheckpointError(f"{draft} has no config.json; pass --speculative-model DIR (a draft checkpoint)")
    return resolve_model(args.model), draft and Path(draft)


def cmd_bench(args) -> int:
    import torch

    from specdecode.bench.bench import BenchConfig, run_bench
    from specdecode.bench.report import write_report

    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.speed:
        return cmd_speed(args)
    target, draft = _checkpoints(args)
    chosen = {"prompts": args.prompts, "max_tokens": args.max_tokens,
              "num_speculative_tokens": args.num_speculative_tokens, "ngram_tokens": args.ngram_tokens,
              "sweep_batch_sizes": args.batch_sizes, "sweep_ks": args.sweep_ks}
    if args.methods is not None:
        chosen["methods"] = tuple(m for m in args.methods.split(",") if m)
    chosen = {k: v for k, v in chosen.items() if v is not None}
    if args.no_sweep or draft is None:
        chosen["sweep_batch_sizes"] = ()
    settings = dict(target=target, draft=draft, out=args.out, dtype=args.dtype, device=args.device,
                    workloads=tuple(w for w in args.workloads.split(",") if w),
                    peers=not args.no_peers, note=args.note, adaptive=args.adaptive, **chosen)
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
                         speculation=not args.quick)
    paths = write_speed_report(run_speed(config), args.out)
    print(paths["report"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
