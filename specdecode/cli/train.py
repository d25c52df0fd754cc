"""`specdecode train tokenizer | lm | distill | all` and `specdecode eval`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

from specdecode.cli.types import POSITIVE, SEED, THREADS, float_range, int_list, int_range
from specdecode.train import loop, recipe


def _add_train_config(parser: argparse.ArgumentParser, defaults: loop.TrainConfig) -> None:
    for field in dataclasses.fields(loop.TrainConfig):
        value = getattr(defaults, field.name)
        kind = int_range(0) if isinstance(value, int) else float_range(0.0)
        parser.add_argument("--" + field.name.replace("_", "-"), type=kind, default=value, help=f"(default {value})")


def _train_config(args) -> loop.TrainConfig:
    return loop.TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(loop.TrainConfig)})


def _add_shape(parser: argparse.ArgumentParser, defaults: dict) -> None:
    for name, value in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=POSITIVE, default=value, help=f"(default {value})")


def _shape(args, defaults: dict) -> dict:
    return {name: getattr(args, name) for name in defaults}


def _corpus_arg(parser: argparse.ArgumentParser) -> None:
    from specdecode.train.data import default_corpus_dir

    parser.add_argument("--corpus", type=Path, default=default_corpus_dir(),
                        help="folder of text files (default: this interpreter's standard library)")
    parser.add_argument("--pattern", default="*.py", help="which files of the corpus to read (default *.py)")
    parser.add_argument("--heldout-fraction", type=float_range(0.0, 1.0, lo_open=True, hi_open=True), default=0.05,
                        help="share of files held out")
    _threads_arg(parser)


def _threads_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=THREADS, default=None,
                        help="CPU threads for torch (default: torch's choice, one per core); on a shared machine "
                             "one thread per process avoids the stalls of oversubscribed cores")


def _set_threads(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def _split(args):
    from specdecode.train import data

    docs = data.read_documents(args.corpus, args.pattern)
    return data.split_documents(docs, args.heldout_fraction)


def cmd_tokenizer(args) -> int:
    _set_threads(args)
    train_docs, _ = _split(args)
    seconds = recipe.run_tokenizer_stage(train_docs, args.out, args.vocab_size, args.model_max_length)
    print(f"tokenizer trained on {len(train_docs)} files in {seconds:.1f}s -> {args.out}")
    return 0


def _train_tokens(args, tokenizer_dir: Path):
    """The training split encoded with the tokenizer in tokenizer_dir (cached under the run directory)."""
    from specdecode.model.tokenizer import Tokenizer
    from specdecode.train import data

    train_docs, _ = _split(args)
    return data.tokenize_documents(train_docs, Tokenizer(tokenizer_dir),
                                   data.token_cache_path(args.run_dir, tokenizer_dir, train_docs))


def cmd_lm(args) -> int:
    _set_threads(args)
    tokens = _train_tokens(args, args.tokenizer)
    cfg = _train_config(args)
    config = recipe.model_config(_shape(args, recipe.TARGET_SHAPE), args.tokenizer, cfg.seq_len)
    model, summary = recipe.run_lm_stage(config, tokens, cfg, args.run_dir / "lm", args.resume)
    recipe.export(model, args.tokenizer, args.out)
    print(json.dumps({"parameters": recipe.param_count(model), **summary}))
    return 0


def cmd_distill(args) -> int:
    _set_threads(args)
    from specdecode.model.loading import load_model

    tokens = _train_tokens(args, args.target)
    cfg = _train_config(args)
    target = load_model(args.target, dtype="float32", device="cpu")
    config = recipe.model_config(_shape(args, recipe.DRAFT_SHAPE), args.target, cfg.seq_len)
    draft, summary = recipe.run_distill_stage(target, config, tokens, cfg, args.run_dir / "distill", args.resume,
                                              args.ce_weight)
    recipe.export(draft, args.target, args.out)
    print(json.dumps({"parameters": recipe.param_count(draft), **summary}))
    return 0


def cmd_all(args) -> int:
    _set_threads(args)
    # The command that reproduces the artifacts; --resume only says how it was run this time.
    argv = [a for a in sys.argv[1:] if a != "--resume"]
    command = "specdecode " + " ".join(shlex.quote(a) for a in argv) if argv else ""
    stages = recipe.run_all(args.out, args.run_dir, args.corpus, args.resume, args.heldout_fraction,
                            eval_tokens=args.eval_tokens, command=command,
                            pattern=args.pattern)
    print(json.dumps(stages["eval"], indent=2))
    return 0


def cmd_eval(args) -> int:
    _set_threads(args)
    from specdecode.model.loading import load_model
    from specdecode.model.tokenizer import Tokenizer
    from specdecode.train import data
    from specdecode.train.evaluate import evaluate

    listing = data.load_heldout_list(args.heldout)
    corpus = Path(args.corpus or listing["corpus"])
    docs = [data.Document(rel, (corpus / rel).read_text(encoding="utf-8")) for rel in listing["files"]]
    target = load_model(args.target, dtype="float32", device="cpu")
    draft = load_model(args.draft, dtype="float32", device="cpu") if args.draft else None
    figures = evaluate(target, draft, Tokenizer(args.target), docs, max_tokens=args.max_tokens,
                       seq_len=args.seq_len, prompts=args.prompts, new_tokens=args.new_tokens)
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def cmd_features(args) -> int:
    _set_threads(args)
    from specdecode.model.loading import load_model
    from specdecode.model.tokenizer import Tokenizer
    from specdecode.catalog.registry import resolve_model
    from specdecode.model.digest import weights_digest
    from specdecode.train import speculators

    args.model = resolve_model(args.model)
    target = load_model(args.model, dtype=args.dtype, device=args.device)
    data = speculators.build_feature_cache(target, Tokenizer(args.model), speculators.resolve_data(args.data),
                                           args.out, args.max_tokens, args.seq_len, extra_layers=args.extra_layers)
    data["target_sha256"] = weights_digest(target)
    (Path(args.out) / "data.json").write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data, indent=1))
    return 0


def cmd_corpus(args) -> int:
    from specdecode.train import corpus

    card = corpus.build(args.out, args.tokens, args.batch, args.max_tokens, args.max_prompt_tokens, args.model,
                        args.threads, split=args.split)
    print(json.dumps(card["stats"], indent=1))
    return 0


def _head_command(kind: str):
    def command(args) -> int:
        from specdecode.train import head_training

        args.kind = kind
        return head_training.run(args)
    return command


def register(sub) -> None:
    from specdecode.catalog import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR

    train = sub.add_parser("train", help="train speculators (eagle, medusa, draft from cached features), a tokenizer, "
                                         "a target model or a distilled draft")
    stages = train.add_subparsers(dest="stage", required=True, metavar="STAGE")

    p = stages.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a folder of text")
    _corpus_arg(p)
    p.add_argument("--out", type=Path, required=True, help="output folder for tokenizer.json and its configs")
    p.add_argument("--vocab-size", type=POSITIVE, default=recipe.VOCAB_SIZE)
    p.add_argument("--model-max-length", type=POSITIVE, default=recipe.SEQ_LEN)
    p.set_defaults(func=cmd_tokenizer)

    p = stages.add_parser("lm", help="pretrain a Llama-architecture model with next-token cross-entropy")
    _corpus_arg(p)
    p.add_argument("--tokenizer", type=Path, required=True, help="folder made by `specdecode train tokenizer`")
    p.add_argument("--run-dir", type=Path, required=True, help="checkpoints, logs and the token cache go here")
    p.add_argument("--out", type=Path, required=True, help="Hugging Face folder for the trained model")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    _add_shape(p, recipe.TARGET_SHAPE)
    _add_train_config(p, recipe.TARGET_TRAIN)
    p.set_defaults(func=cmd_lm)

    p = stages.add_parser("distill", help="distil a small draft model from a target (KL to its distributions)")
    _corpus_arg(p)
    p.add_argument("--target", type=Path, required=True, help="Hugging Face folder of the target (and tokenizer)")
    p.add_argument("--run-dir", type=Path, required=True, help="checkpoints, logs and the token cache go here")
    p.add_argument("--out", type=Path, required=True, help="Hugging Face folder for the draft")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    p.add_argument("--ce-weight", type=float_range(0.0, 1e6), default=recipe.DISTILL_CE_WEIGHT,
                   help="weight of cross-entropy on the data mixed into the KL loss")
    _add_shape(p, recipe.DRAFT_SHAPE)
    _add_train_config(p, recipe.DRAFT_TRAIN)
    p.set_defaults(func=cmd_distill)

    p = stages.add_parser("all", help="the whole recipe of the bundled models, then evaluation and model card")
    _corpus_arg(p)
    p.add_argument("--out", type=Path, default=DEFAULT_TARGET_DIR.parent, help="where target/, draft/ go")
    p.add_argument("--run-dir", type=Path, default=Path("runs/recipe"), help="checkpoints and logs")
    p.add_argument("--resume", action="store_true", help="reuse finished stages, continue the interrupted one")
    p.add_argument("--eval-tokens", type=POSITIVE, default=131072, help="held-out tokens scored by the evaluation")
    p.set_defaults(func=cmd_all)

    p = stages.add_parser("features", help="cache a frozen target's features on conversations (for eagle, "
                                           "medusa and draft training)")
    p.add_argument("--model", required=True, help="target checkpoint")
    p.add_argument("--data", default="sharegpt", help="`sharegpt` or a .json/.jsonl file of conversations")
    p.add_argument("--out", type=Path, required=True, help="cache folder (resumes if it holds shards)")
    p.add_argument("--max-tokens", type=POSITIVE, default=2_000_000, help="training tokens to cache")
    p.add_argument("--seq-len", type=POSITIVE, default=1024, help="conversations are cut at this many tokens")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the target's forward")
    p.add_argument("--extra-layers", type=int_list, default=(),
                   help="comma-separated target layers whose hidden states are cached too, beside the last layer's "
                        "(for `train eagle --feature-layers`, EAGLE-3-style multi-layer features)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    _threads_arg(p)
    p.set_defaults(func=cmd_features)

    p = stages.add_parser("corpus", help="a self-distilled corpus: the target's own answers to ShareGPT training "
                                         "prompts, generated in batches (resumes at the first missing shard)")
    p.add_argument("--out", type=Path, required=True, help="corpus folder (shards and card.json)")
    p.add_argument("--tokens", type=POSITIVE, default=5_000_000, help="answer tokens to reach")
    p.add_argument("--batch", type=POSITIVE, default=32, help="sequences decoded at once")
    p.add_argument("--max-tokens", type=POSITIVE, default=256, help="longest answer")
    p.add_argument("--max-prompt-tokens", type=POSITIVE, default=None,
                   help="longer prompts are skipped (default: the corpus version's, 512)")
    p.add_argument("--model", default=None, help="target (default: the named default model)")
    p.add_argument("--split", choices=("train", "heldout"), default="train",
                   help="answer the training split's prompts (default) or the held-out split's (write it to "
                        "<corpus>/heldout: trainers given the corpus read their held-out figures from there)")
    _threads_arg(p)
    p.set_defaults(func=cmd_corpus)

    for kind, text in (("eagle", "an EAGLE head (one decoder layer on the target's features; EAGLE-2 trees)"),
                       ("medusa", "Medusa heads (residual blocks on the target's last hidden state)"),
                       ("draft", "a small draft model distilled from the target's distributions (draft_model)")):
        p = stages.add_parser(kind, help=f"train {text}")
        p.add_argument("--model", required=True, help="target checkpoint")
        p.add_argument("--data", default="sharegpt",
                       help="`sharegpt`, a .json/.jsonl file of conversations, or a self-distilled corpus folder "
                            "(`specdecode train corpus`; held-out figures from its heldout/ corpus)")
        p.add_argument("--out", type=Path, required=True, help="speculator directory to write")
        p.add_argument("--features", type=Path, default=Path("runs/features"),
                       help="feature cache (built here when missing; shared by eagle and medusa)")
        p.add_argument("--run-dir", type=Path, default=Path(f"runs/{kind}"), help="checkpoints and the loss log")
        p.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint")
        p.add_argument("--export-only", action="store_true",
                       help="write the speculator from the run folder's last checkpoint without training further")
        p.add_argument("--max-tokens", type=POSITIVE, default=2_000_000, help="training tokens in the feature cache")
        p.add_argument("--heldout-tokens", type=POSITIVE, default=65536, help="held-out tokens for the card's figures")
        p.add_argument("--seq-len", type=POSITIVE, default=1024, help="conversations are cut at this many tokens")
        p.add_argument("--window", type=POSITIVE, default=512, help="training windows: longer conversations are cut "
                       "to a random window of this many tokens (attention cost grows with its square)")
        p.add_argument("--feature-dtype", default="bfloat16", help="dtype of the target's forward for features")
        p.add_argument("--draft-vocab", type=POSITIVE, default=16384, help="tokens the head can propose")
        p.add_argument("--steps", type=POSITIVE, default=2000)
        p.add_argument("--batch-tokens", type=POSITIVE, default=4096, help="tokens per optimizer step")
        p.add_argument("--lr", type=float_range(0.0, 10.0, lo_open=True), default=5e-4)
        p.add_argument("--seed", type=SEED, default=0)
        p.add_argument("--unroll", type=POSITIVE, default=3, help="eagle: training-time-test steps")
        p.add_argument("--eagle-init", choices=("random", "last-layer"), default="random",
                       help="eagle: the decoder layer starts random or as a copy of the target's last layer")
        p.add_argument("--feature-layers", type=int_list, default=None,
                       help="eagle: comma-separated target layers the head reads (default: the last; several: "
                            "EAGLE-3-style, e.g. 2,15,29 on SmolLM2's 30 layers)")
        p.add_argument("--num-heads", type=POSITIVE, default=4, help="medusa: heads")
        p.add_argument("--draft-hidden", type=POSITIVE, default=256, help="draft: width (embedding = the target's, "
                       "projected onto its top principal directions)")
        p.add_argument("--draft-layers", type=POSITIVE, default=2, help="draft: decoder layers")
        p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
        p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                       help="bfloat16 autocast (this CPU's bf16 dot products); --no-bf16 for float32")
        _threads_arg(p)
        p.set_defaults(func=_head_command(kind))

    p = sub.add_parser("eval", help="held-out loss of a target and how well a draft predicts it")
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET_DIR)
    p.add_argument("--draft", type=Path, default=DEFAULT_DRAFT_DIR, help="draft folder ('' for target only)")
    p.add_argument("--heldout", type=Path, default=DEFAULT_TARGET_DIR.parent / "heldout.json",
                   help="held-out file list written by `specdecode train all`")
    p.add_argument("--corpus", type=Path, default=None, help="corpus root (default: the one in the list)")
    p.add_argument("--max-tokens", type=POSITIVE, default=131072, help="held-out tokens to score")
    p.add_argument("--seq-len", type=POSITIVE, default=recipe.SEQ_LEN)
    p.add_argument("--prompts", type=POSITIVE, default=64, help="prompts for the greedy-agreement measurement")
    p.add_argument("--new-tokens", type=POSITIVE, default=64, help="greedy tokens generated per prompt")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    _threads_arg(p)
    p.set_defaults(func=cmd_eval)
