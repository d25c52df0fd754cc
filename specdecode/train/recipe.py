"""The recipe that makes the bundled models, stage by stage: tokenizer -> target pretraining -> draft
distillation -> evaluation -> model card. Every stage can be re-entered: with resume=True finished stages are
reused and an interrupted training stage continues from its last checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from specdecode.model.config import ModelConfig
from specdecode.train import data, loop

# torch, the model and the tokenizer are imported where they are used: `specdecode --help` reads this module's
# defaults.

VOCAB_SIZE = 8192
SEQ_LEN = 512

TARGET_SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8)
"""~23.5M parameters with tied embeddings."""
DRAFT_SHAPE = dict(hidden_size=192, intermediate_size=640, num_hidden_layers=2, num_attention_heads=4)
"""~2.6M parameters (< 1/8 of the target); two layers, so that it can learn to copy from its context."""

TARGET_TRAIN = loop.TrainConfig(steps=800, batch_size=2, seq_len=SEQ_LEN, lr=1.5e-3, warmup_steps=40, seed=0,
                                checkpoint_every=25)
DRAFT_TRAIN = loop.TrainConfig(steps=600, batch_size=2, seq_len=SEQ_LEN, lr=2e-3, warmup_steps=30, seed=1,
                               checkpoint_every=25)
DISTILL_CE_WEIGHT = 0.1


def model_config(shape: dict, tokenizer_dir: Path, max_len: int) -> ModelConfig:
    from specdecode.model.tokenizer import Tokenizer

    ids = json.loads((Path(tokenizer_dir) / "generation_config.json").read_text())
    vocab = Tokenizer(tokenizer_dir).vocab_size
    return ModelConfig(vocab_size=vocab, max_position_embeddings=max_len, tie_word_embeddings=True,
                       rope_theta=10000.0, rms_norm_eps=1e-5, bos_token_id=ids["bos_token_id"],
                       eos_token_id=ids["eos_token_id"], **shape)


def export(model, tokenizer_dir: Path, out_dir: Path) -> None:
    """The Hugging Face directory: bfloat16 safetensors + config + tokenizer files."""
    import torch

    from specdecode.model.loading import save_model
    from specdecode.train.tokenizer import copy_tokenizer

    save_model(model, out_dir, dtype=torch.bfloat16)
    copy_tokenizer(tokenizer_dir, out_dir)


def param_count(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class StageLog:
    """Wall time and figures of each finished stage, kept in run_dir/recipe.json across resumes."""

    def __init__(self, path: Path, fresh: bool):
        self.path = path
        self.stages = {} if fresh or not path.is_file() else json.loads(path.read_text())

    def done(self, name: str) -> bool:
        return name in self.stages

    def record(self, name: str, **figures) -> None:
        self.stages[name] = figures
        self.path.write_text(json.dumps(self.stages, indent=2) + "\n")


def run_tokenizer_stage(train_docs, out_dir: Path, vocab_size: int, max_len: int) -> float:
    from specdecode.train.tokenizer import save_tokenizer, train_bpe

    started = time.time()
    tok = train_bpe((d.text for d in train_docs), vocab_size=vocab_size)
    save_tokenizer(tok, out_dir, model_max_length=max_len)
    return time.time() - started


def run_lm_stage(config: ModelConfig, tokens, cfg: loop.TrainConfig, run_dir: Path, resume: bool):
    from specdecode.train.lm import cross_entropy_loss, init_model

    model = init_model(config, cfg.seed)
    summary = loop.train(model, cross_entropy_loss, tokens, cfg, run_dir, resume=resume, desc="target")
    return model, summary


def run_distill_stage(target, config: ModelConfig, tokens, cfg: loop.TrainConfig, run_dir: Path, resume: bool,
                      ce_weight: float):
    from specdecode.train.distill import make_distill_loss
    from specdecode.train.lm import init_model

    draft = init_model(config, cfg.seed)
    loss_fn = make_distill_loss(target, ce_weight=ce_weight)
    summary = loop.train(draft, loss_fn, tokens, cfg, run_dir, resume=resume, desc="draft")
    return draft, summary


def run_all(out_dir: Path, run_dir: Path, corpus: Path, resume: bool, heldout_fraction: float = 0.05,
            target_train: loop.TrainConfig = TARGET_TRAIN, draft_train: loop.TrainConfig = DRAFT_TRAIN,
            target_shape: dict = TARGET_SHAPE, draft_shape: dict = DRAFT_SHAPE, vocab_size: int = VOCAB_SIZE,
            eval_tokens: int = 131072, command: str = "", pattern: str = "*.py") -> dict:
    from specdecode.model.loading import load_model
    from specdecode.model.tokenizer import Tokenizer

    out_dir, run_dir = Path(out_dir), Path(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = StageLog(run_dir / "recipe.json", fresh=not resume)
    max_len = target_train.seq_len

    docs = data.read_documents(corpus, pattern)
    train_docs, heldout_docs = data.split_documents(docs, heldout_fraction)
    data.save_heldout_list(out_dir / "heldout.json", corpus, heldout_docs, heldout_fraction)
    tok_dir = run_dir / "tokenizer"
    if not log.done("tokenizer"):
        seconds = run_tokenizer_stage(train_docs, tok_dir, vocab_size, max_len)
        log.record("tokenizer", wall_time_s=round(seconds, 1), train_files=len(train_docs),
                   heldout_files=len(heldout_docs), train_chars=sum(len(d.text) for d in train_docs))
    cache = data.token_cache_path(run_dir, tok_dir, train_docs)
    started = time.time()
    tokens = data.tokenize_documents(train_docs, Tokenizer(tok_dir), cache)
    if not log.done("pretokenize"):
        log.record("pretokenize", wall_time_s=round(time.time() - started, 1), train_tokens=int(len(tokens)))

    target_config = model_config(target_shape, tok_dir, max_len)
    if not log.done("target"):
        target, summary = run_lm_stage(target_config, tokens, target_train, run_dir / "target", resume)
        export(target, tok_dir, out_dir / "target")
        log.record("target", parameters=param_count(target), config=dataclasses.asdict(target_train), **summary)
    target = load_model(out_dir / "target", dtype="float32", device="cpu")  # distil from the shipped weights

    if not log.done("draft"):
        draft_config = model_config(draft_shape, tok_dir, max_len)
        draft, summary = run_distill_stage(target, draft_config, tokens, draft_train, run_dir / "draft", resume,
                                           DISTILL_CE_WEIGHT)
        export(draft, tok_dir, out_dir / "draft")
        log.record("draft", parameters=param_count(draft), config=dataclasses.asdict(draft_train),
                   ce_weight=DISTILL_CE_WEIGHT, **summary)

    from specdecode.train.evaluate import evaluate, write_model_card

    if not log.done("eval"):
        started = time.time()
        draft = load_model(out_dir / "draft", dtype="float32", device="cpu")
        figures = evaluate(target, draft, Tokenizer(out_dir / "target"), heldout_docs, max_tokens=eval_tokens,
                           seq_len=max_len)
        log.record("eval", wall_time_s=round(time.time() - started, 1), **figures)
    (out_dir / "eval.json").write_text(json.dumps(log.stages["eval"], indent=2) + "\n")
    write_model_card(out_dir, log.stages, corpus=corpus, command=command)
    return log.stages
