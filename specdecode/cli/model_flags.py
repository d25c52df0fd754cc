"""The flags every command that loads a model shares (--model, --dtype, --device, --threads, the speculative and
sampling flags), and how they become a model path and a speculative_config before anything loads.

Without --model a command uses the default named model (fetched on first use) with the speculator shipped for it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.catalog.registry import (DEFAULT_MODEL, MODELS, default_speculative_config, is_name, model_name,
                                         prefetch, resolve_model, shipped_speculator)
from specdecode.cli.types import (SEED, SPECULATIVE_TOKENS, TEMPERATURE, THREADS, TOKENS, existing_path, float_range,
                                  int_range)
from specdecode.errors import ConfigError
from specdecode.speculation import methods
from specdecode.speculation.config import DRAFT_KINDS, with_shipped_speculator


def add_model_args(p, dtype: str = "auto", adaptive: bool = True, model: str | None = None, why: str = "") -> None:
    """--model, --dtype, --device, --threads and the speculative flags (shared by generate, chat, serve, plan and
    certify). dtype: the command's default; adaptive: whether it offers --adaptive/--no-adaptive; model: the
    command's default model (None: DEFAULT_MODEL), and why it is not the default model."""
    p.add_argument("--model", default=model,
                   help=f"a model name ({', '.join(MODELS)}; fetched on first use), a .gguf file, or a Hugging Face "
                        f"checkpoint directory (default: {model or DEFAULT_MODEL}{why})")
    add_device_args(p, dtype)
    p.add_argument("--threads", type=THREADS, default=None,
                   help="CPU threads for torch (default: torch's choice; 1 is faster on a busy machine)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", choices=methods.names(), default=None,
                      help=", ".join(f"{name} ({methods.summary(name)})" for name in methods.names()))
    spec.add_argument("--speculative-model", type=_speculative_model, default=None,
                      help="draft checkpoint directory, .gguf or model name (draft_model; a name is fetched on first "
                           "use), speculator directory (eagle, medusa; "
                           "default: the one shipped for the named model) or datastore directory (rest; default: the "
                           "named model's, built on first use)")
    spec.add_argument("--num-speculative-tokens", type=SPECULATIVE_TOKENS, default=None,
                      help="draft tokens per step K, 1-64 (default 5; adaptive: the most)")
    spec.add_argument("--num-drafts", type=int_range(1, 16), default=None,
                      help="draft_model: chains per step, 1-16 (default 1)")
    spec.add_argument("--no-speculation", action="store_true", help="plain decoding")
    if adaptive:
        spec.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                          help="choose K per step from measured costs and acceptance, 0 while drafts do not pay "
                               "(default); --no-adaptive always drafts K tokens")


def add_device_args(p, dtype: str = "auto") -> None:
    """--dtype and --device (shared by every command that loads a model); dtype: the command's default."""
    auto = "bfloat16 on CUDA and on CPUs with native bfloat16, else float32"
    p.add_argument("--dtype", default=dtype, choices=DTYPE_CHOICES,
                   help=", ".join(f"{name} (default{': ' + auto if name == 'auto' else ''})" if name == dtype else
                                  f"{name} ({auto})" if name == "auto" else name for name in DTYPE_CHOICES))
    p.add_argument("--device", default=None, type=_device,
                   help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def _device(text: str) -> str:
    """--device: a device torch knows of (checked before anything loads; importing torch takes ~1 s)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: this machine has no CUDA device (use cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: there are {torch.cuda.device_count()} CUDA devices")
    return text


def add_quantization_arg(p) -> None:
    p.add_argument("--quantization", choices=("auto", "none", "gguf", "q8_0", "q4_0", "q4_1", "int8"), default="auto",
                   help="auto (default): a GGUF's matrices stay quantized as shipped on the CPU (gguf; specdecode's "
                        "own kernels, compiled once for this machine); none: float weights; q8_0/q4_0/q4_1: quantize "
                        "every matrix at load; int8: torch's weight-only int8 (with --dtype bfloat16)")


def add_penalty_args(p, min_p: float = 0.0, presence: float = 0.0, frequency: float = 0.0,
                     repetition: float = 1.0) -> None:
    """--min-p and the three penalties (SamplingParams' names and ranges; shared by generate, chat and certify)."""
    p.add_argument("--min-p", type=float_range(0.0, 1.0), default=min_p,
                   help="drop tokens below this share of the most likely one's probability; 0 = off (default)")
    p.add_argument("--presence-penalty", type=float_range(-2.0, 2.0), default=presence,
                   help="subtracted from the logit of every token the output already holds (default 0)")
    p.add_argument("--frequency-penalty", type=float_range(-2.0, 2.0), default=frequency,
                   help="subtracted once per occurrence in the output (default 0)")
    p.add_argument("--repetition-penalty", type=float_range(0.0, 10.0, lo_open=True), default=repetition,
                   help="divides positive (multiplies negative) logits of tokens in the prompt or output; 1 = off")


def add_sampling_args(p, temperature: float = 0.0, top_p: float = 1.0, max_tokens: int = 128) -> None:
    p.add_argument("--max-tokens", type=TOKENS, default=max_tokens,
                   help=f"most tokens to generate (default {max_tokens})")
    p.add_argument("--temperature", type=TEMPERATURE, default=temperature,
                   help=f"0 = greedy; > 0 samples (default {temperature:g})")
    p.add_argument("--top-p", type=float_range(0.0, 1.0, lo_open=True), default=top_p,
                   help=f"nucleus sampling mass in (0, 1] (default {top_p:g})")
    p.add_argument("--top-k", type=int_range(0), default=0, help="keep the k most likely tokens; 0 = all (default)")
    p.add_argument("--seed", type=SEED, default=None, help="random seed for sampling")
    p.add_argument("--sampler", choices=("auto", "race", "rejection"), default="auto",  # sampling.SAMPLERS
                   help="auto (default): the exponential race for a seeded request (the same text with or without "
                        "speculation), rejection sampling without a seed; race; rejection")
    add_penalty_args(p)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="the answer is JSON valid against this schema (JSON text, or @FILE)")
    shape.add_argument("--json", action="store_true", help="the answer is a JSON object")
    shape.add_argument("--regex", default=None, help="the answer matches this regular expression")


def resolve_models(args) -> tuple[Path, dict | None, str]:
    """(target checkpoint path, speculative_config, model name to show/serve) from --model and the speculative
    flags; shared by `generate`, `chat` and `serve`. A named model is fetched here on first use."""
    config = speculative_config(args, default_speculative_config(args.model))  # (flags checked before a fetch)
    prefetch(args.model, config)  # the target and a named draft under one progress bar
    config = with_shipped_speculator(config, args.model)  # eagle/medusa without a path: the shipped heads
    return resolve_model(args.model), config, model_name(args.model)


def speculative_config(args, default: dict | None = None) -> dict | None:
    """The speculative_config the flags describe (None = plain decoding).

    default: the speculator shipped for the chosen named model (used when no flag says otherwise), or None.
    """
    flags = (args.speculative_method, args.speculative_model, args.num_speculative_tokens, args.num_drafts)
    if args.no_speculation:
        if getattr(args, "compare", False):
            raise ConfigError("--compare needs speculation; drop --no-speculation")
        if any(f is not None for f in flags):
            raise ConfigError("--no-speculation contradicts the speculative flags given; drop one or the other")
        return None
    if all(f is None for f in flags):
        if default is None and getattr(args, "compare", False):
            raise ConfigError("--compare needs a speculative method: add --speculative-model DIR or "
                              "--speculative-method ngram")
        return _fixed_k(args, dict(default)) if default is not None else None
    # As in vLLM: a draft model when one is given, prompt lookup otherwise.
    drafts = default is not None and methods.get(default.get("method", "draft_model")).model in DRAFT_KINDS
    default_draft = default.get("model") if drafts else None
    has_draft = args.speculative_model is not None or default_draft is not None
    method = args.speculative_method or _speculator_kind(args.speculative_model) or (
        "draft_model" if has_draft else "ngram")
    config: dict = {"method": method}
    kind = methods.get(method).model
    if kind == "draft":
        if args.speculative_model is not None:
            config["model"] = str(args.speculative_model)
        elif default_draft is not None:
            config["model"] = default_draft
        elif shipped_speculator(getattr(args, "model", None), method) is None:  # (else resolve_models adds it)
            raise ConfigError(f"--speculative-method {method} needs --speculative-model DIR (a draft checkpoint with "
                              "the target's tokenizer)")
        if args.num_drafts is not None:
            config["num_drafts"] = args.num_drafts
    elif kind in ("speculator", "datastore", "draft or datastore") and args.num_drafts is None:
        if args.speculative_model is not None:  # (else resolve_models fills in the shipped speculator, if any)
            config["model"] = str(args.speculative_model)
    elif args.speculative_model is not None or args.num_drafts is not None:
        raise ConfigError(f"--speculative-model and --num-drafts do not apply to --speculative-method {method}")
    if args.num_speculative_tokens is not None:
        config["num_speculative_tokens"] = args.num_speculative_tokens
    if args.speculative_model is not None:
        _check_speculative_model(method, args.speculative_model)
    return _fixed_k(args, config)


def _speculative_model(text: str) -> Path:
    """--speculative-model: an existing path, or a catalog name (a draft_model's draft, resolved with --model's)."""
    return Path(text) if is_name(text) else existing_path(text)


def _check_speculative_model(method: str, path: Path) -> None:
    """Refuse a --speculative-model that cannot be what the method needs, before any model loads."""
    kind = methods.get(method).model
    if is_name(path):
        if kind not in DRAFT_KINDS:
            raise ConfigError(f"--speculative-model {path}: a model name is a draft for --speculative-method "
                              f"draft_model or auto, not for {method}; pass a directory")
        return  # fetched and checked by the catalog (with_shipped_speculator)
    if kind == "draft or datastore":  # auto: a datastore joins as rest, anything else as a draft
        kind = "datastore" if (path / "datastore.json").is_file() else "draft"
    if kind == "draft":
        gguf = path.suffix == ".gguf" and path.is_file() or path.is_dir() and any(path.glob("*.gguf"))
        if not gguf and not (path / "config.json").is_file():
            raise ConfigError(f"--speculative-model {path}: not a draft checkpoint (a directory with config.json "
                              "and model.safetensors, or a .gguf file)")
    elif kind == "speculator":
        missing = [name for name in ("config.json", "model.safetensors") if not (path / name).is_file()]
        if missing:
            raise ConfigError(f"--speculative-model {path}: not a speculator directory ({' and '.join(missing)} "
                              f"missing); write one with `specdecode train {method}`")
    elif kind == "datastore" and not (path / "datastore.json").is_file():
        raise ConfigError(f"--speculative-model {path}: not a REST datastore (datastore.json missing); build one "
                          "with `specdecode datastore build`")


def _fixed_k(args, config: dict) -> dict:
    """--no-adaptive: the config drafts a fixed K (adaptive is the default, so it is only ever switched off)."""
    return {**config, "adaptive": False} if getattr(args, "adaptive", True) is False else config


def _speculator_kind(folder: Path | None) -> str | None:
    """The method of a speculator directory (its config.json names its kind: eagle, medusa) or of a datastore
    directory (rest), else None."""
    import json

    if folder is not None and (folder / "datastore.json").is_file():
        return next(name for name in methods.names() if methods.get(name).model == "datastore")
    try:
        kind = json.loads((folder / "config.json").read_text()).get("kind") if folder is not None else None
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in methods.names() and methods.get(kind).model == "speculator" else None


def set_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def sampling_params(args):
    from specdecode.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed, sampler=args.sampler, min_p=args.min_p,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty, structured=structured(args))


def structured(args) -> dict | None:
    """SamplingParams.structured from --json-schema / --json / --regex (the grammar compiles when the model's
    tokenizer is known; the spec's shape is checked by SamplingParams)."""
    if args.regex is not None:
        return {"regex": args.regex}
    if args.json:
        return {"json_object": True}
    if args.json_schema is None:
        return None
    import json

    text = args.json_schema
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise ConfigError(f"--json-schema {args.json_schema}: cannot read the file ({exc.strerror})") from None
    try:
        return {"json_schema": json.loads(text)}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--json-schema is not JSON ({exc.msg} at character {exc.pos}); give a schema or @FILE") \
            from None
