"""`speculative_config`: vLLM-style options, validated, and the proposer they describe. What differs between methods
is their `Method` (speculation/methods.py), never a branch on the name here."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from specdecode.errors import ConfigError
from specdecode.speculation import methods

DRAFT_KINDS = ("draft", "draft or datastore")
"""Method.model kinds whose "model" may be a draft checkpoint (a catalog name is fetched as one)."""
MAX_SPECULATIVE_TOKENS = 64
"""The most draft levels a step may verify (deeper drafts never pay, and start-up times every depth)."""


@dataclasses.dataclass
class SpeculativeConfig:
    """Which method drafts and how much (vLLM's names)."""

    method: str = "draft_model"
    """A registered method's name (speculation/methods.py)."""
    model: str | None = None
    """Draft checkpoint directory (draft_model), speculator directory (eagle, medusa; default: the one shipped
    for the named model) or datastore directory (rest; default: the named model's, built on first use); auto: a
    draft checkpoint or a datastore, which then joins its sources."""
    num_speculative_tokens: int = 5
    """Draft tokens per chain per step (K); eagle and medusa: the deepest tree level."""
    num_drafts: int = 1
    """draft_model: chains per step (> 1 makes a tree that branches at the root)."""
    eagle_topk: int = 4
    """eagle: nodes expanded per depth and children kept per expanded node (SGLang's speculative_eagle_topk)."""
    num_tree_nodes: int | None = None
    """eagle, medusa, rest: draft tokens verified per step at full depth (default 4 per level); a shallower tree
    gets a proportional share."""
    prompt_lookup_max: int = 4
    """ngram: longest n-gram matched."""
    prompt_lookup_min: int = 1
    """ngram: shortest n-gram matched."""
    lookahead_ngram: int = 5
    """lookahead: N, tokens per pooled n-gram; drafts are at most N - 1 deep."""
    lookahead_window: int = 7
    """lookahead: W, Jacobi window columns at full depth (a shallower step gets a proportional share)."""
    lookahead_guesses: int = 7
    """lookahead: G, pooled n-grams verified per step at full depth (a shallower step: a proportional share)."""
    suffix_max_tokens: int = 100_000
    """suffix: tokens of finished requests its suffix tree keeps (the oldest finished requests are evicted first)."""
    suffix_max_depth: int = 64
    """suffix: longest string indexed from each position (the matched suffix plus its draft)."""
    suffix_min_prob: float = 0.5
    """suffix: least estimated probability of a drafted node (continuation frequencies along its path, multiplied)."""
    suffix_spec_factor: float = 1.0
    """suffix: draft levels per matched token at most (a short match drafts little)."""
    auto_sources: list[str] | None = None
    """auto: the methods whose trees it merges (default ngram and suffix, and draft_model or rest when "model"
    names a draft checkpoint or a datastore)."""
    disable_by_batch_size: int | None = None
    """Stop speculating when this many sequences run at once."""
    adaptive: bool = True
    """Choose the draft length per step (0..num_speculative_tokens) from measured costs and acceptance rates, so
    that drafts that do not pay stop (K = 0, probed again later); False drafts num_speculative_tokens always."""

    def __post_init__(self):
        method = methods.get(self.method)  # (refuses an unknown name)
        if (not isinstance(self.num_speculative_tokens, int) or isinstance(self.num_speculative_tokens, bool)
                or not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise ConfigError(f"num_speculative_tokens (--num-speculative-tokens) must be an integer between 1 and "
                              f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens!r}")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or self.disable_by_batch_size < 1):
            raise ConfigError(f"disable_by_batch_size must be a positive integer, got {self.disable_by_batch_size!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"adaptive must be true or false, got {self.adaptive!r}")
        if method.model_required and not self.model:
            what = {"draft": "the draft checkpoint directory", "speculator": f"a speculator directory written by "
                    f"`specdecode train {self.method}`", "datastore": "a datastore directory",
                    "draft or datastore": "a draft checkpoint or a datastore directory"}[method.model]
            raise ConfigError(f'the {self.method} method needs "model" (--speculative-model): {what}')
        if not isinstance(self.lookahead_ngram, int) or self.lookahead_ngram < 2:
            raise ConfigError(f"lookahead_ngram (N) must be an integer >= 2, got {self.lookahead_ngram!r}")
        if self.auto_sources is not None and (not isinstance(self.auto_sources, (list, tuple)) or not all(
                isinstance(name, str) for name in self.auto_sources) or not self.auto_sources):
            raise ConfigError(f"auto_sources must be a non-empty list of method names, got {self.auto_sources!r}")
        for name in ("eagle_topk", "num_tree_nodes", "lookahead_window", "lookahead_guesses"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    @property
    def tree_nodes(self) -> int:
        """eagle, medusa, rest: the most nodes a tree has."""
        return self.num_tree_nodes or 4 * self.num_speculative_tokens

    @property
    def method_info(self) -> methods.Method:
        """The registered method."""
        return methods.get(self.method)

    @property
    def max_depth(self) -> int:
        """The deepest draft a step verifies (the speculation controller's largest K)."""
        return self.method_info.max_depth(self)

    @property
    def nodes_per_level(self) -> int:
        """Tree nodes verified per drafted level (what the speculation controller's costs are measured for)."""
        return self.method_info.nodes_per_level(self)

    def pass_nodes(self, k: int) -> int:
        """Nodes one sequence adds to the target pass when it drafts k levels (lookahead: its window too)."""
        return self.method_info.nodes(self, k)

    @property
    def pass_widths(self) -> list[int]:
        """Target pass width per row for each draft length 0..max_depth (what the controller's costs are for)."""
        return [1 + self.pass_nodes(k) for k in range(self.max_depth + 1)]

    @property
    def tree_size(self) -> int:
        """The most nodes one sequence adds to a step's target pass (draft tokens, and lookahead's window; a
        structured request's forced run)."""
        return max(self.pass_nodes(self.max_depth), self.method_info.forced_run)

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


def with_shipped_speculator(raw: "dict | SpeculativeConfig | None", model: str | Path | None):
    """Fill in the speculator shipped for a named model when an eagle/medusa/draft_model config names none (kept
    as is when there is none: build_proposer then says what to pass), and replace a draft given by catalog name
    (e.g. "qwen2.5-coder-0.5b-instruct") by its GGUF, fetched on first use."""
    from specdecode.catalog.registry import is_name, resolve, shipped_speculator

    method = raw.get("method") if isinstance(raw, dict) else getattr(raw, "method", None)
    given = raw.get("model") if isinstance(raw, dict) else getattr(raw, "model", None)
    if raw is None:
        return raw
    kind = methods.get(method or "draft_model").model
    if kind in DRAFT_KINDS and is_name(given):
        path = resolve(str(given))
    elif given or kind not in ("draft", "speculator"):
        return raw
    else:
        path = shipped_speculator(model, method)
    if path is None:
        return raw
    return {**raw, "model": str(path)} if isinstance(raw, dict) else dataclasses.replace(raw, model=str(path))


def build_proposer(config: SpeculativeConfig | None, target, target_tokenizer, dtype, device,
                   target_dir: Path | None = None):
    """The proposer for a config (None = plain decoding); checks a draft model or speculator against the target
    first. target_dir: the target's checkpoint."""
    if config is None:
        return None
    return config.method_info.build(config, methods.BuildContext(target, target_tokenizer, dtype, device, target_dir))


def load_head(config: SpeculativeConfig, target, kind: str):
    """The heads of a speculator directory (eagle, medusa) for this target, with the target's linear kernels."""
    from specdecode.model.digest import weights_digest
    from specdecode.model.linear import linear_backend, prepare_for_inference
    from specdecode.model.quant import quantize_linears, speculator_format
    from specdecode.speculation.heads import HeadConfig
    from specdecode.speculation.heads import load_head as read_head

    if not config.model:
        raise ConfigError(f'the {kind} method needs "model" (--speculative-model): a speculator directory written '
                          f"by `specdecode train {kind}`; none is shipped for this target")
    folder = Path(config.model)
    found = HeadConfig.read(folder).kind
    if found != kind:
        raise ConfigError(f"{folder} holds a speculator of kind {found!r}, not {kind!r}: use --speculative-method "
                          f"{found} (method {found!r})")
    head = read_head(folder, target, weights_digest(target))  # ~1 s for SmolLM2
    head = prepare_for_inference(head, linear_backend(target))  # the target's linear kernels
    fmt = speculator_format(target)
    return quantize_linears(head, fmt) if fmt else head  # beside a quantized target: its fused kernels
