"""Speculator heads that read the target's hidden states: an EAGLE head and Medusa heads.

Both predict over a draft vocabulary, a subset of the target's (the most frequent tokens of the training data,
as EAGLE-3 does), through rows of the target's own frozen output head; `draft_to_target` maps draft ids back.
Verification stays lossless: the verifier only needs q at the tokens that were drafted.

A trained head is a directory: config.json (shape, kind, the sha256 of the target weights it was trained
for), model.safetensors (its weights, without the frozen target rows, which are taken from the target at load)
and README.md (its card).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from specdecode.errors import CheckpointError, ConfigError
from specdecode.model.llama import LlamaForCausalLM


@dataclasses.dataclass
class HeadConfig:
    """What a speculator directory's config.json holds."""

    kind: str
    """'eagle' or 'medusa'."""
    target_sha256: str
    """Digest of the target weights the head was trained for (see model.digest.weights_digest)."""
    draft_vocab_size: int
    """Number of target tokens the head can propose."""
    num_heads: int = 1
    """medusa: heads, head i proposing the token i + 2 positions after the last verified one."""
    topk_accuracy: list | None = None
    """Held-out accuracy per head (eagle: per depth) and rank r: P(target's greedy token in the top r)."""
    topk_ranks: list | None = None
    """The ranks r of topk_accuracy's columns."""
    feature_layers: list | None = None
    """eagle: the target layers whose hidden states the head reads (None: the last; several: EAGLE-3-style)."""

    @classmethod
    def read(cls, folder: Path) -> "HeadConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: a speculator directory needs config.json and "
                                  "model.safetensors (written by `specdecode train eagle|medusa`)")
        try:
            raw = json.loads(path.read_text())
            return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw})
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise CheckpointError(f"{path} is corrupt ({exc}); re-train or re-download the speculator") from exc


def rank_accuracy(topk_accuracy: list[list[float]], ranks: list[int] | None = None) -> list[list[float]]:
    """Per head, P(the head's rank-r token is the right one) for r = 1..max rank, from its cumulative top-r
    accuracies measured at `ranks` (default 1, 2, ...); between measured ranks the cumulative accuracy is
    interpolated linearly (from 0 at rank 0)."""
    out = []
    for row in topk_accuracy:
        at = [0] + list(ranks or range(1, len(row) + 1))
        values = [0.0] + [float(a) for a in row]
        if len(at) != len(values) or any(a >= b for a, b in zip(at, at[1:])):
            raise ConfigError(f"topk_accuracy rows must hold one accuracy per rank of {at[1:]}, got {row}")
        cumulative = []
        for r in range(1, at[-1] + 1):
            j = next(i for i, x in enumerate(at) if x >= r)
            cumulative.append(values[j - 1] + (values[j] - values[j - 1]) * (r - at[j - 1]) / (at[j] - at[j - 1]))
        out.append([max(0.0, c - p) for c, p in zip(cumulative, [0.0] + cumulative[:-1])])
    return out


def draft_head_rows(target: LlamaForCausalLM, draft_to_target: torch.Tensor) -> nn.Linear:
    """The target's output head restricted to the draft vocabulary (a frozen copy of those rows)."""
    source = target.model.embed_tokens if target.config.tie_word_embeddings else target.lm_head
    weight = source.weight.detach()[draft_to_target]  # [Vd, D]
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return head


class EagleHead(nn.Module):
    """EAGLE-1: feature_{t+1} = layer(fc([embed(token_{t+1}); feature_t])), logits = lm_head(norm(feature)).

    The layer is one decoder layer of the target's shape, run through our decoder (so it has a KV cache, tree
    masks and pending positions like any model); the embedding, final norm and output head are the target's,
    frozen. Features are the target's last-layer hidden states before the final norm. With several
    `feature_layers` (EAGLE-3-style), the feature of a committed token is instead `reduce` of those layers' hidden
    states, each scaled to unit RMS; drafted tokens still carry the head's own predicted features.
    """

    def __init__(self, target: LlamaForCausalLM, draft_to_target: torch.Tensor,
                 feature_layers: tuple[int, ...] | None = None):
        super().__init__()
        tc = target.config
        d = tc.hidden_size
        self.last_layer = last = tc.num_hidden_layers - 1
        self.feature_layers = tuple(sorted(set(feature_layers))) if feature_layers else (last,)
        if any(not 0 <= i <= last for i in self.feature_layers):
            raise CheckpointError(f"EAGLE feature layers {list(self.feature_layers)}: the target has layers 0..{last}")
        if len(self.feature_layers) > 1:
            self.reduce = nn.Linear(len(self.feature_layers) * d, d, bias=False)
        config = dataclasses.replace(tc, num_hidden_layers=1, vocab_size=len(draft_to_target),
                                     tie_word_embeddings=False)
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.decoder = LlamaForCausalLM(config)
        # Inputs come as embeddings of target ids (below): the decoder's own table is never read.
        self.decoder.model.embed_tokens = nn.Embedding(1, d).requires_grad_(False)
        self.decoder.model.norm.weight = nn.Parameter(target.model.norm.weight.detach().clone(),
                                                      requires_grad=False)
        self.decoder.lm_head = draft_head_rows(target, draft_to_target)
        self.embed = target.model.embed_tokens.requires_grad_(False)  # shared with the target, frozen
        self.register_buffer("draft_to_target", draft_to_target.clone(), persistent=False)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The weights a head directory stores: fc (and reduce) and the decoder layer."""
        return {k: v for k, v in self.state_dict().items()
                if k.startswith(("fc.", "reduce.", "decoder.model.layers."))}

    def target_features(self, hidden: list[torch.Tensor]) -> torch.Tensor:
        """The target's hidden states [..., D] at feature_layers (in that order) -> the head's features [..., D]."""
        if len(self.feature_layers) == 1:
            return hidden[0]
        scaled = [h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype) for h in hidden]
        return self.reduce(torch.cat(scaled, dim=-1))

    def fuse(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (target ids), features [B, T, D] -> layer inputs [B, T, D].

        Features go through the target's final norm first: the raw residual stream has outlier dimensions
        thousands of times larger than the embeddings (SmolLM2: RMS ~25, one dimension ~4,700), and the head's
        own predictions, fed back at the next depth, then need only be right up to scale."""
        emb = self.embed(tokens).to(features.dtype)
        return self.fc(torch.cat([emb, self.decoder.model.norm(features)], dim=-1))

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, **decoder_kwargs):
        """One cached forward: returns (next features [B, T, D] before the norm, draft logits [B, T, Vd])."""
        out = self.decoder(tokens, inputs_embeds=self.fuse(tokens, features), hidden_layers=(0,), **decoder_kwargs)
        return out.layer_hidden[0], out.logits


class ResBlock(nn.Module):
    """x + SiLU(W x + b), initialised to the identity (W = 0), as in Medusa."""

    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """Medusa-1: head i maps the target's normed last hidden state at t to a guess of token t + 2 + i, through
    one residual block and the target's frozen output head (restricted to the draft vocabulary)."""

    def __init__(self, target: LlamaForCausalLM, draft_to_target: torch.Tensor, num_heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(target.config.hidden_size) for _ in range(num_heads))
        self.lm_head = draft_head_rows(target, draft_to_target)
        self.register_buffer("draft_to_target", draft_to_target.clone(), persistent=False)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k.startswith("blocks.")}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] (normed) -> logits [num_heads, N, Vd] (one pass of the output rows for every head)."""
        return self.lm_head(torch.stack([block(hidden) for block in self.blocks]))


def save_head(head: EagleHead | MedusaHeads, config: HeadConfig, folder: Path, card: str) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.trainable_state().items()}
    state["draft_to_target"] = head.draft_to_target.to(torch.int32)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1) + "\n")
    (folder / "README.md").write_text(card)


def load_head(folder: Path, target: LlamaForCausalLM, target_sha256: str | None) -> EagleHead | MedusaHeads:
    """A trained head for this target. target_sha256 (None = not checked) must match the one it was trained
    for: a head used on other weights would draft garbage, silently slowly."""
    folder = Path(folder)
    config = HeadConfig.read(folder)
    if target_sha256 is not None and config.target_sha256 != target_sha256:
        raise CheckpointError(f"the speculator in {folder} was trained for other target weights "
                              f"(sha256 {config.target_sha256[:12]}..., this target {target_sha256[:12]}...); "
                              "train one for this target with `specdecode train`")
    try:
        state = load_file(str(folder / "model.safetensors"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / 'model.safetensors'} is missing or corrupt ({exc})") from exc
    draft_to_target = state.pop("draft_to_target").long()
    if config.kind == "eagle":
        head = EagleHead(target, draft_to_target, config.feature_layers)
    elif config.kind == "medusa":
        head = MedusaHeads(target, draft_to_target, config.num_heads)
    else:
        raise CheckpointError(f"{folder / 'config.json'}: kind {config.kind!r} is unknown; use 'eagle' or 'medusa'")
    expected = head.trainable_state()
    if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
        raise CheckpointError(f"weights in {folder} do not match a {config.kind} head for this target's shape")
    head.load_state_dict({k: v.to(target.dtype) for k, v in state.items()}, strict=False)
    head = head.to(target.device, target.dtype).eval()
    if isinstance(head, EagleHead):  # rotary frequencies stay float32, as in the target
        head.decoder.inv_freq = target.config.inv_freq().to(target.device)
    for p in head.parameters():
        p.requires_grad_(False)
    return head
