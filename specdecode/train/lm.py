"""Pretraining a Llama-architecture target model with next-token cross-entropy."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.model.config import ModelConfig
from specdecode.model.llama import LlamaForCausalLM


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
