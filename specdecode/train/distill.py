"""Distilling a draft model from a target on a text corpus (`specdecode train distill`): forward
KL(p_target || q_draft) on the target's full next-token distributions at temperature 1, optionally mixed with a
little cross-entropy on the data.

Forward KL makes the draft cover the target's probability mass, which is what the acceptance rate of
speculative sampling, sum_x min(p, q) = 1 - TV(p, q), rewards.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.model.config import ModelConfig
from specdecode.model.llama import LlamaForCausalLM
from specdecode.train import loop
from specdecode.train.lm import init_model


def kl_to_target(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p || q); logits [N, V]."""
    log_p = F.log_softmax(target_logits.float(), dim=-1)
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def make_distill_loss(target: LlamaForCausalLM, ce_weight: float = 0.0):
    """loss_fn for the training loop: the target runs without gradients on the same batch as the draft."""
    target.eval().requires_grad_(False)

    def loss_fn(draft: LlamaForCausalLM, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with torch.no_grad():
            target_logits = target(inputs).logits  # [B, T, V]
        draft_logits = draft(inputs).logits  # [B, T, V]
        V = draft_logits.shape[-1]
        kl = kl_to_target(target_logits.reshape(-1, V), draft_logits.reshape(-1, V))
        ce = F.cross_entropy(draft_logits.reshape(-1, V), labels.reshape(-1))
        loss = (1 - ce_weight) * kl + ce_weight * ce
        return loss, {"kl": kl.item(), "ce": ce.item()}

    return loss_fn


def distill(target: LlamaForCausalLM, config: ModelConfig, tokens, cfg: loop.TrainConfig, run_dir: Path,
            resume: bool, ce_weight: float) -> tuple[LlamaForCausalLM, dict]:
    """Train a fresh draft of this config towards the target on random windows of tokens; (draft, summary)."""
    draft = init_model(config, cfg.seed)
    loss_fn = make_distill_loss(target, ce_weight=ce_weight)
    summary = loop.train(draft, loss_fn, tokens, cfg, run_dir, resume=resume, desc="draft")
    return draft, summary
