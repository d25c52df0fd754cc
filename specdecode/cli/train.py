"""`specdecode train STAGE`: speculators for a target (corpus, features, eagle, medusa, draft) and, from scratch on
a folder of text, a tokenizer, a small target and a draft distilled from it (tokenizer, lm, distill)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from specdecode.cli.types import POSITIVE, SEED, THREADS, float_range, int_list, int_range
from specdecode.train import loop

# torch and the trainers are imported where they are used: `specdecode --help` reads these defaults.
SEQ_LEN = 512
TARGET_SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8)
"""`train lm`: ~23.5M parameters with tied embeddings and an 8,192-token vocabulary."""
DRAFT_SHAPE = dict(hidden_size=192, intermediate_size=640, num_hidden_layers=2, num_attention_heads=4)
"""`train distill`: ~2.6M parameters (< 1/8 of the target); two layers, so that it can learn to copy from its
context."""
TARGET_TRAIN = loop.TrainConfig(steps=800, batch_size=2, seq_len=SEQ_LEN, lr=1.5e-3, warmup_steps=40, seed=0,
                                checkpoint_every=25)
DRAFT_TRAIN = loop.TrainConfig(steps=600, batch_size=2, seq_len=SEQ_LEN, lr=2e-3, warmup_steps=30, seed=1,
                               checkpoint_every=25)
DISTILL_CE_WEIGHT = 0.1


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
    from specdecode.train.tokenizer import save_tokenizer, train_bpe

    train_docs, _ = _split(args)
    started = time.time()
    save_tokenizer(train_bpe((d.text for d in train_docs), vocab_size=args.vocab_size), args.out,
                   model_max_length=args.model_max_length)
    print(f"tokenizer trained on {len(train_docs)} files in {time.time() - started:.1f}s -> {args.out}")
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
    from specdecode.train import lm

    tokens = _train_tokens(args, args.tokenizer)
    cfg = _train_config(args)
    config = lm.model_config(_shape(args, TARGET_SHAPE), args.tokenizer, cfg.seq_len)
    model, summary = lm.pretrain(config, tokens, cfg, args.run_dir / "lm", args.resume)
    lm.export(model, args.tokenizer, args.out)
    print(json.dumps({"parameters": lm.param_count(model), **summary}))
    return 0


def cmd_distill(args) -> int:
    _set_threads(args)
    from specdecode.model.loading import load_model
    from specdecode.train import lm
    from specdecode.train.distill import distill

    tokens = _train_tokens(args, args.target)
    cfg = _train_config(args)
    target = load_model(args.target, dtype="float32", device="cpu")
    config = lm.model_config(_shape(args, DRAFT_SHAPE), args.target, cfg.seq_len)
    draft, summary = distill(target, config, tokens, cfg, args.run_dir / "distill", args.resume, args.ce_weight)
    lm.export(draft, args.target, args.out)
    print(json.dumps({"parameters": lm.param_count(draft), **summary}))
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
    train = sub.add_parser("train", help="train speculators (eagle, medusa, draft from cached features), a tokenizer, "
                                         "a target model or a distilled draft")
    stages = train.add_subparsers(dest="stage", required=True, metavar="STAGE")

    p = stages.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a folder of text")
    _corpus_arg(p)
    p.add_argument("--out", type=Path, required=True, help="output folder for tokenizer.json and its configs")
    p.add_argument("--vocab-size", type=POSITIVE, default=8192)
    p.add_argument("--model-max-length", type=POSITIVE, default=SEQ_LEN)
    p.set_defaults(func=cmd_tokenizer)

    p = stages.add_parser("lm", help="pretrain a Llama-architecture model with next-token cross-entropy")
    _corpus_arg(p)
    p.add_argument("--tokenizer", type=Path, required=True, help="folder made by `specdecode train tokenizer`")
    p.add_argument("--run-dir", type=Path, required=True, help="checkpoints, logs and the token cache go here")
    p.add_argument("--out", type=Path, required=True, help="Hugging Face folder for the trained model")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    _add_shape(p, TARGET_SHAPE)
    _add_train_config(p, TARGET_TRAIN)
    p.set_defaults(func=cmd_lm)

    p = stages.add_parser("distill", help="distil a small draft model from a target (KL to its distributions)")
    _corpus_arg(p)
    p.add_argument("--target", type=Path, required=True, help="Hugging Face folder of the target (and tokenizer)")
    p.add_argument("--run-dir", type=Path, required=True, help="checkpoints, logs and the token cache go here")
    p.add_argument("--out", type=Path, required=True, help="Hugging Face folder for the draft")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    p.add_argument("--ce-weight", type=float_range(0.0, 1e6), default=DISTILL_CE_WEIGHT,
                   help="weight of cross-entropy on the data mixed into the KL loss")
    _add_shape(p, DRAFT_SHAPE)
    _add_train_config(p, DRAFT_TRAIN)
    p.set_defaults(func=cmd_distill)

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
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="target (default: smollm2-135m-instruct, the target of the shipped EAGLE and Medusa heads "
                        "and of docs/training.md's figures)")
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
        p.add_argument("--draft-init", default=None,
                       help="draft: start from this model (a name or checkpoint with the target's tokenizer, e.g. "
                            "qwen2.5-coder-0.5b-instruct) cut to --draft-layers layers (its first ones and its last) "
                            "instead of a fresh small model; its embedding and head stay as they are")
        p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
        p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                       help="bfloat16 autocast (this CPU's bf16 dot products); --no-bf16 for float32")
        _threads_arg(p)
        p.set_defaults(func=_head_command(kind))
