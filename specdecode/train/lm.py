"""Pretraining a Llama-architecture model from scratch with next-token cross-entropy (`specdecode train lm`), and
the Hugging Face folder it is exported to."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.model.config import ModelConfig
from specdecode.model.llama import LlamaForCausalLM
from specdecode.train import loop


def model_config(shape: dict, tokenizer_dir: Path, max_len: int) -> ModelConfig:
    """A tied-embedding Llama of this shape (hidden_size, intermediate_size, layers, heads) over the tokenizer's
    vocabulary and special tokens."""
    from specdecode.model.tokenizer import Tokenizer

    ids = json.loads((Path(tokenizer_dir) / "generation_config.json").read_text())
    vocab = Tokenizer(tokenizer_dir).vocab_size
    return ModelConfig(vocab_size=vocab, max_position_embeddings=max_len, tie_word_embeddings=True,
                       rope_theta=10000.0, rms_norm_eps=1e-5, bos_token_id=ids["bos_token_id"],
                       eos_token_id=ids["eos_token_id"], **shape)


def init_model(config: ModelConfig, seed: int) -> LlamaForCausalLM:
    """A fresh model: normal(0, 0.02) weights, residual output projections scaled down by depth (GPT-2)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    residual_std = 0.02 / (2 * config.num_hidden_layers) ** 0.5
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = residual_std if name.endswith(("o_proj", "down_proj")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    return model


def cross_entropy_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Mean next-token cross-entropy of batch [B, T+1]."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs).logits  # [B, T, V]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss, {}


def pretrain(config: ModelConfig, tokens, cfg: loop.TrainConfig, run_dir: Path,
             resume: bool) -> tuple[LlamaForCausalLM, dict]:
    """Train a fresh model on random windows of tokens; (model, the loop's summary)."""
    model = init_model(config, cfg.seed)
    summary = loop.train(model, cross_entropy_loss, tokens, cfg, run_dir, resume=resume, desc="target")
    return model, summary


def export(model: LlamaForCausalLM, tokenizer_dir: Path, out_dir: Path) -> None:
    """The Hugging Face folder: bfloat16 safetensors + config + the tokenizer's files."""
    from specdecode.model.loading import save_model
    from specdecode.train.tokenizer import copy_tokenizer

    save_model(model, out_dir, dtype=torch.bfloat16)
    copy_tokenizer(tokenizer_dir, out_dir)


def param_count(model: nn.Module) -> int:
    """Parameters, tied ones counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
