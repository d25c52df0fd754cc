"""Training EAGLE and Medusa heads on a frozen target's cached features.

Both learn the target's next-token distribution (soft cross-entropy on its cached top-k probabilities, over
the draft vocabulary): what decides acceptance is agreeing with the target, not with the data's text.

EAGLE is trained with its own predictions fed back (training-time test, as in EAGLE-3): unroll step s takes
(token_{t+s}, the feature predicted by step s-1) and predicts feature_{t+s}, attending to the real-feature
entries of positions <= t and to its own earlier unroll steps at t, exactly what drafting at depth s sees.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from specdecode.speculation.heads import EagleHead, MedusaHeads
from specdecode.train.features import FeatureBatch


@dataclasses.dataclass
class HeadLossConfig:
    """How the head losses are weighed."""

    unroll: int = 3
    """EAGLE: training-time-test steps (1 = EAGLE-1: real features only)."""
    step_decay: float = 0.8
    """EAGLE: weight of unroll step s is step_decay ** (s - 1)."""
    feature_weight: float = 0.5
    """EAGLE: weight of the smooth-L1 loss between predicted and real (normed) features."""
    noise: float = 0.05
    """EAGLE: uniform multiplicative noise on the real input features (each value times 1 + U(-noise, noise))."""


def soft_cross_entropy(logits: torch.Tensor, topk_draft: torch.Tensor, topk_probs: torch.Tensor) -> torch.Tensor:
    """-sum_k p_k log q(token_k) per position. logits [N, Vd]; topk_draft [N, K] draft ids, -1 = not in the
    draft vocabulary (skipped); topk_probs [N, K] the target's probabilities."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    known = topk_draft >= 0
    picked = logq.gather(1, topk_draft.clamp(min=0))
    return -(topk_probs * picked * known).sum(-1)


def _shift(t: torch.Tensor, s: int) -> torch.Tensor:
    """t[:, i + s] at index i ([B, T, ...]); the last s positions are zero/False."""
    out = torch.zeros_like(t)
    out[:, :-s] = t[:, s:]
    return out


class _UnrolledContext:
    """Stands in for the decoder's cache context during an unrolled step: keeps the keys/values of every step
    so far (the first from real features) and lets query t see step-1 keys <= t and, of every later step, only
    its own position t."""

    def __init__(self, T: int, device: torch.device):
        self.causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        self.eye = torch.eye(T, dtype=torch.bool, device=device)
        self.keys, self.values = [], []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, heads, T, hd], k/v [B, kv_heads, T, hd] of this step -> attention output [B, heads, T, hd]."""
        self.keys.append(k)
        self.values.append(v)
        mask = torch.cat([self.causal] + [self.eye] * (len(self.keys) - 1), dim=1)  # [T, s * T]
        return F.scaled_dot_product_attention(q, torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2),
                                              attn_mask=mask, enable_gqa=True)


@dataclasses.dataclass
class StepOutput:
    """One unroll step (eagle) or head (medusa), at the N selected positions (answer tokens)."""

    logits: torch.Tensor  # [N, Vd]
    topk_draft: torch.Tensor  # [N, K]: the target's top-k tokens as draft ids (-1 = outside the draft vocabulary)
    topk_probs: torch.Tensor  # [N, K]
    predicted: torch.Tensor | None = None  # [N, D] eagle: predicted feature, normed
    real: torch.Tensor | None = None  # [N, D] eagle: the target's feature, normed


def eagle_unroll(head: EagleHead, batch: FeatureBatch, target_to_draft: torch.Tensor, cfg: HeadLossConfig,
                 generator: torch.Generator | None = None):
    """Yield a StepOutput per unroll step s = 1..cfg.unroll (noise only when a generator is given)."""
    layer = head.decoder.model.layers[0]
    norm = head.decoder.model.norm
    B, T = batch.tokens.shape
    real = batch.features.float()  # [B, T, D]
    hidden = batch.layer_features(head.feature_layers, head.last_layer)
    if generator is not None and cfg.noise > 0:
        # Relative to each value: an additive scale from the RMS would swamp the ordinary dimensions, since a
        # few outlier dimensions dominate the RMS of the residual stream.
        hidden = [h * (1 + cfg.noise * (torch.rand(h.shape, generator=generator).to(h.device) * 2 - 1))
                  for h in hidden]
    feature_in = head.target_features(hidden)
    real_normed = norm(real)
    topk_draft = target_to_draft[batch.topk_ids]  # [B, T, K]
    ctx = _UnrolledContext(T, real.device)
    for s in range(1, cfg.unroll + 1):
        # Index t of this step reads token_{t+s} and the feature of position t+s-1, and predicts position t+s.
        x = head.fuse(_shift(batch.tokens, s), feature_in)  # [B, T, D]
        cos, sin = head.decoder.rotary((torch.arange(T, device=real.device) + s - 1).expand(B, T))
        out = layer(x.reshape(B * T, -1), cos, sin, ctx).view(B, T, -1)  # predicted feature_{t+s}
        selected = _shift(batch.valid & batch.is_answer, s)  # [B, T]
        predicted = norm(out)[selected]  # [N, D]
        yield StepOutput(head.decoder.lm_head(predicted), _shift(topk_draft, s)[selected],
                         _shift(batch.topk_probs, s)[selected], predicted, _shift(real_normed, s)[selected])
        feature_in = out


def eagle_loss(head: EagleHead, batch: FeatureBatch, target_to_draft: torch.Tensor, cfg: HeadLossConfig,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    total, extra = 0.0, {"tokens": batch.num_tokens}
    for s, out in enumerate(eagle_unroll(head, batch, target_to_draft, cfg, generator), start=1):
        cls = soft_cross_entropy(out.logits, out.topk_draft, out.topk_probs).mean()
        reg = F.smooth_l1_loss(out.predicted, out.real)
        total = total + cfg.step_decay ** (s - 1) * (cls + cfg.feature_weight * reg)
        extra[f"acc{s}"] = (out.logits.argmax(-1) == out.topk_draft[:, 0]).float().mean().detach()
        extra[f"cls{s}"] = cls.detach()
    return total, extra


def medusa_outputs(heads: MedusaHeads, batch: FeatureBatch, target_to_draft: torch.Tensor, norm):
    """Yield a StepOutput per head: head i at position t learns the target's distribution at t + 1 + i."""
    hidden = norm(batch.features.float())  # [B, T, D]
    topk_draft = target_to_draft[batch.topk_ids]
    for i, block in enumerate(heads.blocks):
        shift = 1 + i
        selected = (batch.valid & batch.is_answer)[:, shift:]  # [B, T - shift]
        yield StepOutput(heads.lm_head(block(hidden[:, :-shift][selected])), topk_draft[:, shift:][selected],
                         batch.topk_probs[:, shift:][selected])


def medusa_loss(heads: MedusaHeads, batch: FeatureBatch, target_to_draft: torch.Tensor, norm) -> tuple[torch.Tensor, dict]:
    total, extra = 0.0, {"tokens": batch.num_tokens}
    for i, out in enumerate(medusa_outputs(heads, batch, target_to_draft, norm), start=1):
        total = total + soft_cross_entropy(out.logits, out.topk_draft, out.topk_probs).mean()
        extra[f"acc{i}"] = (out.logits.argmax(-1) == out.topk_draft[:, 0]).float().mean().detach()
    return total / len(heads.blocks), extra


def draft_outputs(draft, batch: FeatureBatch, target_to_draft: torch.Tensor):
    """A draft model's next-token logits at the answer positions, against the target's top-k there."""
    logits = draft(batch.tokens).logits  # [B, T, V]
    selected = batch.valid & batch.is_answer
    yield StepOutput(logits[selected], target_to_draft[batch.topk_ids][selected], batch.topk_probs[selected])


def draft_loss(draft, batch: FeatureBatch, target_to_draft: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Distillation of a small model: soft cross-entropy to the target's cached next-token distributions."""
    out = next(draft_outputs(draft, batch, target_to_draft))
    loss = soft_cross_entropy(out.logits, out.topk_draft, out.topk_probs).mean()
    return loss, {"tokens": batch.num_tokens, "acc1": (out.logits.argmax(-1) == out.topk_draft[:, 0]).float().mean()}


def draft_from_target(target, hidden: int, layers: int, intermediate: int):
    """A small model in the target's vocabulary whose tied embedding is the target's projected onto its top
    `hidden` principal directions: the draft starts knowing which tokens are alike."""
    import dataclasses as dc

    from specdecode.model.llama import LlamaForCausalLM

    tc = target.config
    heads = max(1, hidden // 64)
    config = dc.replace(tc, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                        tie_word_embeddings=True)
    draft = LlamaForCausalLM(config)
    with torch.no_grad():
        emb = target.model.embed_tokens.weight.float()  # [V, D]
        _, _, v = torch.svd_lowrank(emb - emb.mean(0), q=hidden, niter=4)  # v [D, hidden]
        projected = emb @ v
        draft.model.embed_tokens.weight.copy_(projected / projected.std() * 0.02 ** 0.5)
    draft.lm_head.weight = draft.model.embed_tokens.weight
    return draft


def shallow_layers(total: int, keep: int) -> list[int]:
    """Which of a model's `total` decoder layers a `keep`-layer copy of it keeps: the first keep - 1 and the last
    (the last maps the stack's output into the space the final norm and head read, which the layers before it do not:
    the 0.5B cut to its first 16 of 24 layers agreed with the 1.5B on 4% of tokens, docs/bench/draft_vocab_2026-12-05)."""
    if not 1 <= keep <= total:
        raise ValueError(f"--draft-layers {keep}: the initial model has {total} decoder layers; keep 1 to {total}")
    return list(range(keep - 1)) + [total - 1]


def cut_layers(model, keep: int):
    """`model` with only `keep` of its decoder layers (shallow_layers), renumbered for a cache of the new depth."""
    import dataclasses as dc

    kept = shallow_layers(model.config.num_hidden_layers, keep)
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in kept)
    for new, layer in enumerate(model.model.layers):  # each layer's cache row is its position in the stack
        layer.self_attn.layer_idx = new
    model.config = dc.replace(model.config, num_hidden_layers=keep)
    model.__dict__.pop("_fused_layers", None)
    return model


def draft_from_model(model, keep: int, train_embeddings: bool = False):
    """A draft that starts as `model` (a smaller model of the target's family, float weights) cut to `keep` decoder
    layers (cut_layers), to be distilled on the target's distributions; its embedding (and a head tied to it) stays
    as it is unless train_embeddings (the layers have the most to relearn, and a 151,936-token head is most of a
    step's gradient work)."""
    model = cut_layers(model, keep).requires_grad_(True)
    if not train_embeddings:
        model.model.embed_tokens.requires_grad_(False)
        model.lm_head.requires_grad_(False)
    return model


EAGLE_INITS = ("random", "last-layer")
"""How an EAGLE head's decoder layer starts: random (as EAGLE does), or a copy of the target's last decoder layer
with fc passing the token's embedding plus the normed feature (the layer then starts out as the computation that
made the feature, applied once more)."""


def init_eagle(head, target, how: str) -> None:
    if how not in EAGLE_INITS:
        raise ValueError(f"unknown EAGLE init {how!r}; choose one of {', '.join(EAGLE_INITS)}")
    if how == "random":
        return
    d = target.config.hidden_size
    with torch.no_grad():
        head.decoder.model.layers[0].load_state_dict(target.model.layers[-1].state_dict())
        eye = torch.eye(d)
        head.fc.weight.copy_(torch.cat([eye, eye], dim=1))
        head.fc.bias.zero_()
