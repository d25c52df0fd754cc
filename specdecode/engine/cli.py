"""`specdecode generate`: stream one prompt's completion to the terminal, then report the decoding speed.

With the bundled target and no speculative flags it speculates with the bundled draft; `--compare` runs plain
and speculative decoding on the same prompt and prints the speedup.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from specdecode.errors import CheckpointError, ConfigError
from specdecode.spec.config import METHODS


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt, with speculative decoding",
                       description="Stream a completion of PROMPT, then print tokens/s (and, when speculating, "
                                   "the acceptance rate and tokens per target step).")
    p.add_argument("prompt", help="text to complete")
    p.add_argument("--model", type=Path, default=None,
                   help="Hugging Face checkpoint directory (default: specdecode's bundled target)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all (default)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--dtype", default="auto", help="auto (default), float32, bfloat16 or float16")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice; 1 is faster on a busy machine)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", choices=METHODS, default=None,
                      help="draft_model (a small model drafts) or ngram (prompt lookup)")
    spec.add_argument("--speculative-model", type=Path, default=None,
                      help="draft checkpoint directory (default with the bundled target: the bundled draft)")
    spec.add_argument("--num-speculative-tokens", type=int, default=None, help="draft tokens per step K (default 5)")
    spec.add_argument("--num-drafts", type=int, default=None, help="draft_model: chains per step (default 1)")
    spec.add_argument("--no-speculation", action="store_true", help="plain decoding")
    spec.add_argument("--compare", action="store_true",
                      help="run plain and speculative decoding on the prompt and print the speedup")
    p.set_defaults(func=cmd_generate)


def _bundled_dirs() -> tuple[Path, Path] | None:
    """(target, draft) directories of specdecode's bundled models, or None if that package is absent."""
    try:
        from specdecode.models import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR
    except ImportError:
        return None
    return Path(DEFAULT_TARGET_DIR), Path(DEFAULT_DRAFT_DIR)


def _require_bundled(path: Path, what: str) -> Path:
    if not (path / "config.json").is_file():
        raise CheckpointError(f"the bundled {what} is missing ({path} has no config.json); train it with "
                              "`specdecode train all`, or pass --model DIR (and --speculative-model DIR)")
    return path


def resolve_models(args) -> tuple[Path, dict | None, bool]:
    """(target directory, speculative_config, whether the target is the bundled one) from --model and the
    speculative flags; shared by `generate` and `serve`."""
    bundled = _bundled_dirs()
    if args.model is None:
        if bundled is None:
            raise CheckpointError("specdecode's bundled models are not installed; pass --model DIR")
        model_dir = _require_bundled(bundled[0], "target model")
    else:
        model_dir = args.model
    is_bundled_target = bundled is not None and model_dir.resolve() == bundled[0].resolve()
    return model_dir, speculative_config(args, bundled[1] if is_bundled_target else None), is_bundled_target


def speculative_config(args, bundled_draft: Path | None) -> dict | None:
    """The speculative_config the flags describe (None = plain decoding).

    bundled_draft: the bundled draft directory when the target is the bundled target, else None.
    """
    flags = (args.speculative_method, args.speculative_model, args.num_speculative_tokens, args.num_drafts)
    if args.no_speculation:
        if args.compare:
            raise ConfigError("--compare needs speculation; drop --no-speculation")
        if any(f is not None for f in flags):
            raise ConfigError("--no-speculation contradicts the speculative flags given; drop one or the other")
        return None
    if all(f is None for f in flags) and bundled_draft is None:
        if args.compare:
            raise ConfigError("--compare needs a speculative method: add --speculative-model DIR or "
                              "--speculative-method ngram")
        return None  # a user's checkpoint has no known draft: plain decoding unless asked
    # As in vLLM: a draft model when one is given (or bundled), prompt lookup otherwise.
    has_draft = args.speculative_model is not None or bundled_draft is not None
    method = args.speculative_method or ("draft_model" if has_draft else "ngram")
    config: dict = {"method": method}
    if method == "draft_model":
        if args.speculative_model is not None:
            config["model"] = str(args.speculative_model)
        elif bundled_draft is not None:
            config["model"] = str(_require_bundled(bundled_draft, "draft model"))
        else:
            raise ConfigError("--speculative-method draft_model needs --speculative-model DIR (a draft "
                              "checkpoint with the target's tokenizer)")
        if args.num_drafts is not None:
            config["num_drafts"] = args.num_drafts
    elif args.speculative_model is not None or args.num_drafts is not None:
        raise ConfigError("--speculative-model and --num-drafts apply to --speculative-method draft_model only")
    if args.num_speculative_tokens is not None:
        config["num_speculative_tokens"] = args.num_speculative_tokens
    return config


def _stream(llm, prompt: str, params, label: str | None = None):
    """Print the prompt and its completion as it arrives; returns (tokens/s, SpecStats)."""
    if label:
        print(f"[{label}]")
    print(prompt, end="", flush=True)
    start = time.perf_counter()
    for delta in llm.stream(prompt, params):
        print(delta, end="", flush=True)
    elapsed = time.perf_counter() - start
    print()
    stats = llm.last_stats
    return stats.emitted_tokens / elapsed, stats


def _spec_summary(stats, config: dict) -> str:
    return (f"{config['method']}, K={config.get('num_speculative_tokens', 5)}: "
            f"acceptance rate {stats.acceptance_rate:.1%}, "
            f"{stats.mean_accepted_len:.2f} tokens per step")


def cmd_generate(args) -> int:
    from specdecode.engine.llm import LLM
    from specdecode.sampling import SamplingParams

    model_dir, config, _ = resolve_models(args)
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(model=model_dir, dtype=args.dtype, device=args.device, speculative_config=config)
    try:
        if not args.compare:
            tps, stats = _stream(llm, args.prompt, params)
            line = f"{stats.emitted_tokens} tokens, {tps:.1f} tokens/s"
            if config is not None:
                line += f" ({_spec_summary(stats, config)})"
            print(line)
            return 0
        plain_params = dataclasses.replace(params, use_speculation=False)
        # Warm both paths up so that neither timed run pays one-time start-up costs.
        llm.generate(args.prompt, dataclasses.replace(plain_params, max_tokens=2))
        llm.generate(args.prompt, dataclasses.replace(params, max_tokens=2))
        plain_tps, _ = _stream(llm, args.prompt, plain_params, "plain")
        spec_tps, stats = _stream(llm, args.prompt, params, "speculative")
        print(f"plain: {plain_tps:.1f} tokens/s | speculative: {spec_tps:.1f} tokens/s "
              f"({_spec_summary(stats, config)}) | speedup {spec_tps / plain_tps:.2f}x")
        return 0
    except KeyboardInterrupt:
        print()
        return 130
