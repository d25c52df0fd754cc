"""`specdecode certify`: run speculative sampling on real prompts and test that the emitted tokens follow the target's
processed distribution; prints p-values and a verdict, exits 1 on failure, writes a JSON report with --json."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from specdecode.cli.types import MAX_NUM_SEQS, PROBABILITY, SEED, TOKENS, float_range, int_range
from specdecode.certify.prompts import SOURCES
from specdecode.certify.run import DEFAULT_SAMPLES, CertifyConfig


class CertifyDefaults:
    """CertifyConfig's field defaults, read without constructing one."""

    def __getattr__(self, name: str):
        field = {f.name: f for f in dataclasses.fields(CertifyConfig)}[name]
        return field.default


def register(sub) -> None:
    from specdecode.cli.model_flags import add_model_args, add_penalty_args

    d = CertifyDefaults()  # (building a CertifyConfig would import torch: --help stays fast)
    p = sub.add_parser("certify", help="test that speculative sampling is lossless for a model and its speculator",
                       description="Sample with speculation (a fixed K: every step drafts K tokens), recompute the "
                                   "target's distribution at every emitted token with a plain float32 forward, and "
                                   "test the tokens against it (PIT uniformity, mean p(token) and ranks; see "
                                   "docs/certify.md). The engine runs in float32 unless --dtype names another type.")
    add_model_args(p, dtype="float32", adaptive=False, model="smollm2-135m-instruct",
                   why=": a float32 recomputation of every emitted token's distribution; docs/certify.md's figures "
                       "are its")
    p.add_argument("--temperature", type=float_range(0.0, 100.0, lo_open=True), default=d.temperature,
                   help=f"(default {d.temperature:g})")
    p.add_argument("--top-p", type=PROBABILITY, default=d.top_p, help=f"(default {d.top_p:g})")
    p.add_argument("--top-k", type=int_range(0), default=d.top_k, help="0 = off (default)")
    add_penalty_args(p, d.min_p, d.presence_penalty, d.frequency_penalty, d.repetition_penalty)
    p.add_argument("--samples", type=int_range(16, 10_000_000), default=DEFAULT_SAMPLES,
                   help=f"emitted tokens to test (default {DEFAULT_SAMPLES})")
    p.add_argument("--max-tokens", type=TOKENS, default=d.max_tokens,
                   help=f"tokens per request (default {d.max_tokens})")
    p.add_argument("--prompts", choices=SOURCES, default=d.prompts,
                   help="auto (default): held-out ShareGPT first turns if the data set is downloaded, else a built-in "
                        "set; sharegpt downloads it if needed")
    p.add_argument("--sampler", choices=("race", "rejection"), default=d.sampler,  # sampling.SAMPLERS
                   help="race (default): the exponential race, verified by identity; rejection: rejection sampling")
    p.add_argument("--seed", type=SEED, default=d.seed, help=f"(default {d.seed})")
    p.add_argument("--alpha", type=float_range(0.0, 1.0, lo_open=True, hi_open=True), default=d.alpha,
                   help=f"fail below this p-value (default {d.alpha:g})")
    p.add_argument("--max-num-seqs", type=MAX_NUM_SEQS, default=16, help="requests sampled at once (default 16)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.set_defaults(func=cmd_certify, compare=False, adaptive=False)


def cmd_certify(args) -> int:
    from specdecode.certify.run import certify
    from specdecode.cli.model_flags import resolve_models, set_threads
    from specdecode.engine.llm import LLM
    from specdecode.errors import ConfigError

    set_threads(args.threads)
    config = CertifyConfig(samples=args.samples, max_tokens=args.max_tokens, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                           presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                           repetition_penalty=args.repetition_penalty, seed=args.seed, alpha=args.alpha, prompts=args.prompts,
                           sampler=args.sampler)
    if args.no_speculation:
        raise ConfigError("certify tests speculation: drop --no-speculation")
    model_dir, spec, name = resolve_models(args)
    if spec is None:
        raise ConfigError("no speculative method for this model: give --speculative-method or --speculative-model")
    spec = {**spec, "adaptive": False}  # every step drafts K: the most positions exposed to the acceptance rule
    llm = LLM(model=model_dir, dtype=args.dtype, device=args.device, speculative_config=spec,
              max_num_seqs=args.max_num_seqs)
    llm.model_name = name
    report = certify(llm, config)
    print(report.summary())
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return 0 if report.verdict.passed else 1
