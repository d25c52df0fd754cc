"""`speculative_config`: vLLM-style options, validated, and the proposer they describe."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from specdecode.errors import ConfigError

METHODS = ("draft_model", "ngram")


@dataclasses.dataclass
class SpeculativeConfig:
    """Which method drafts and how much (vLLM's names)."""

    method: str = "draft_model"
    """One of METHODS."""
    model: str | None = None
    """Draft checkpoint directory (draft_model)."""
    num_speculative_tokens: int = 5
    """Draft tokens per chain per step (K)."""
    num_drafts: int = 1
    """draft_model: chains per step (> 1 makes a tree that branches at the root)."""
    prompt_lookup_max: int = 4
    """ngram: longest n-gram matched."""
    prompt_lookup_min: int = 1
    """ngram: shortest n-gram matched."""
    disable_by_batch_size: int | None = None
    """Stop speculating when this many sequences run at once."""
    adaptive: bool = False
    """Choose the draft length per step (0..num_speculative_tokens) from measured costs and acceptance rates."""

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"speculative method {self.method!r} is unknown; use one of {', '.join(METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be a positive integer, got {self.num_speculative_tokens!r}")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or self.disable_by_batch_size < 1):
            raise ConfigError(f"disable_by_batch_size must be a positive integer, got {self.disable_by_batch_size!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError('the draft_model method needs "model": the draft checkpoint directory')

    @property
    def tree_size(self) -> int:
        return self.num_speculative_tokens * (self.num_drafts if self.method == "draft_model" else 1)

    @classmethod
    def parse(cls, raw: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        if raw is None or isinstance(raw, cls):
            return raw
        if not isinstance(raw, dict):
            raise ConfigError(f"speculative_config must be a dict, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(raw.keys() - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config key(s) {unknown}; known keys: {sorted(known)}")
        raw = dict(raw)
        if raw.get("model") == "[ngram]":  # vLLM's older spelling
            raw.pop("model")
            raw.setdefault("method", "ngram")
        if "method" not in raw:
            raw["method"] = "draft_model" if raw.get("model") else "ngram"
        return cls(**raw)


def build_proposer(config: SpeculativeConfig | None, target, target_tokenizer, dtype, device):
    """The proposer for a config (None = plain decoding); checks a draft model against the target first."""
    if config is None:
        return None
    if config.method == "ngram":
        from specdecode.spec.proposers.ngram import NgramConfig, NgramProposer

        return NgramProposer(NgramConfig(config.num_speculative_tokens, config.prompt_lookup_max,
                                         config.prompt_lookup_min))
    from specdecode.model.config import ModelConfig
    from specdecode.model.loading import load_model
    from specdecode.model.tokenizer import Tokenizer
    from specdecode.spec.compat import check_compatible
    from specdecode.spec.proposers.draft_model import DraftModelConfig, DraftModelProposer

    draft_dir = Path(config.model)
    draft_cfg = ModelConfig.from_file(draft_dir / "config.json")
    check_compatible(target_tokenizer, Tokenizer(draft_dir, draft_cfg.eos_token_ids), target.config, draft_cfg)
    draft = load_model(draft_dir, dtype=dtype, device=device)
    return DraftModelProposer(DraftModelConfig(str(draft_dir), config.num_speculative_tokens, config.num_drafts),
                              draft)
