"""`specdecode generate`: stream one prompt's completion to the terminal, then report the decoding speed;
`--compare` runs plain and speculative decoding on the same prompt and prints the speedup (and why the texts
differ, if they do)."""
from __future__ import annotations

import dataclasses
import random
import time

from specdecode.cli.model_flags import (add_model_args, add_quantization_arg, add_sampling_args, resolve_models,
                                        sampling_params, set_threads)
from specdecode.cli.scaleout import add_scaleout_args, scaleout_kwargs
from specdecode.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt, with speculative decoding",
                       description="Stream a completion of PROMPT, then print tokens/s (and, when speculating, "
                                   "the acceptance rate and tokens per target step).")
    p.add_argument("prompt", help="text to complete (with --chat: a user message)")
    p.add_argument("--chat", action="store_true",
                   help="wrap PROMPT in the model's chat template as one user message and print only the answer")
    add_model_args(p)
    add_quantization_arg(p)
    add_scaleout_args(p)
    add_sampling_args(p)
    p.add_argument("--compare", action="store_true",
                   help="run plain and speculative decoding on the prompt and print the speedup")
    p.set_defaults(func=cmd_generate)


def _stream(llm, prompt: str, params, label: str | None = None, echo: bool = True):
    """Print the prompt (if echo) and its completion as it arrives; returns (tokens/s, SpecStats)."""
    if label:
        print(f"[{label}]")
    if echo:
        print(prompt, end="", flush=True)
    start = time.perf_counter()
    pieces = []
    for delta in llm.stream(prompt, params):
        print(delta, end="", flush=True)
        pieces.append(delta)
    elapsed = time.perf_counter() - start
    print()
    stats = llm.last_stats
    return stats.emitted_tokens / elapsed, stats, "".join(pieces)


def _spec_summary(stats, config: dict) -> str:
    k = config.get("num_speculative_tokens", 5)
    return (f"{config['method']}, {f'adaptive K<={k}' if config.get('adaptive', True) else f'K={k}'}: "
            f"acceptance rate {stats.acceptance_rate:.1%}, "
            f"{stats.mean_accepted_len:.2f} tokens per step")


def compare_difference(plain: str, speculative: str, params, target) -> str:
    """Why the plain and speculative texts of --compare differ, where they part."""
    from specdecode.sampling import raced

    same = next((i for i, (a, b) in enumerate(zip(plain, speculative)) if a != b), min(len(plain), len(speculative)))
    where = f"the texts differ from character {same}"
    if not params.greedy and not raced(params):
        return (f"{where}: with --sampler rejection the sampled text depends on what was drafted (both follow the "
                "same distribution; certify tests it); the default race sampler gives one text per seed")
    if not target.batch_invariant:
        name = str(target.dtype).removeprefix("torch.")
        return (f"{where}: with float weights ({name}), verifying several tokens in one pass and decoding one at a "
                "time use different matrix kernels that can round differently, so where two tokens are almost tied "
                "the choice can flip; block-quantized weights (a GGUF's, the default, or --quantization q8_0) run "
                "kernels that compute every row the same way")
    return f"{where}: with batch-invariant kernels the outputs must be identical; this is a bug, please report it"


def cmd_generate(args) -> int:
    from specdecode.engine.llm import LLM

    if args.prompt == "":
        raise ConfigError("the prompt is empty; give some text to complete (or, with --chat, a message)")
    set_threads(args.threads)
    params = sampling_params(args)  # (checked before a model is fetched or loaded)
    model_dir, config, _ = resolve_models(args)
    llm = LLM(model=model_dir, dtype=args.dtype, device=args.device, speculative_config=config, max_num_seqs=1,
              quantization=args.quantization, **scaleout_kwargs(args))
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    try:
        if not args.compare:
            tps, stats, _ = _stream(llm, prompt, params, echo=not args.chat)
            line = f"{stats.emitted_tokens} tokens, {tps:.1f} tokens/s"
            if config is not None:
                line += f" ({_spec_summary(stats, config)})"
            print(line)
            return 0
        if not params.greedy and params.seed is None:  # one seed for both runs: the race then gives one text
            params = dataclasses.replace(params, seed=random.randrange(2**31))
        plain_params = dataclasses.replace(params, use_speculation=False)
        # Warm both paths up so that neither timed run pays one-time start-up costs.
        llm.generate(prompt, dataclasses.replace(plain_params, max_tokens=2))
        llm.generate(prompt, dataclasses.replace(params, max_tokens=2))
        plain_tps, _, plain_text = _stream(llm, prompt, plain_params, "plain", echo=not args.chat)
        spec_tps, stats, spec_text = _stream(llm, prompt, params, "speculative", echo=not args.chat)
        print(f"plain: {plain_tps:.1f} tokens/s | speculative: {spec_tps:.1f} tokens/s "
              f"({_spec_summary(stats, config)}) | speedup {spec_tps / plain_tps:.2f}x")
        if spec_text != plain_text:
            print(compare_difference(plain_text, spec_text, params, llm.target))
        return 0
    except KeyboardInterrupt:
        print()
        return 130
