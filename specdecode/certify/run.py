"""A certification run: sample with speculation, then recompute the target's processed distribution at every emitted
position with a plain (teacher-forced, float32) forward, and test that the tokens were drawn from it.

    report = certify(LLM(model, dtype="float32", speculative_config={...}), CertifyConfig(temperature=0.7))
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING

from specdecode.errors import ConfigError

if TYPE_CHECKING:  # imported where they are used: `specdecode --help` reads CertifyConfig's defaults
    import torch

    from specdecode.certify.stats import PositionStats, Verdict
    from specdecode.sampling import SamplingParams

DEFAULT_SAMPLES = 4096
"""Emitted tokens tested by default: enough that each broken verifier of tests/certify fails with p < 1e-6 (docs/
certify.md has the figures); the time this takes on SmolLM2 is in the issue's note."""


@dataclasses.dataclass
class CertifyConfig:
    """What to sample and how to judge it."""

    samples: int = DEFAULT_SAMPLES
    """Emitted tokens to test (rounded up to whole requests of max_tokens)."""
    max_tokens: int = 64
    """Tokens generated per request (end-of-sequence ignored, so every position counts and the tests' samples are
    exactly iid under the null)."""
    temperature: float = 1.0
    """Sampling temperature (> 0: certify tests sampling; greedy exactness is a plain comparison)."""
    top_p: float = 1.0
    """Nucleus mass."""
    top_k: int = 0
    """Top-k (0 = off)."""
    min_p: float = 0.0
    """min_p (0 = off)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None
    structured: dict | None = None
    """Penalties and logit_bias (SamplingParams'): the reference distribution of each position applies them from
    the prompt and the answer before it."""
    sampler: str = "race"
    """SamplingParams.sampler: "race" (the default: identity verification of the race's winners) or "rejection"
    (rejection sampling of the drafts)."""
    seed: int = 0
    """Seeds the requests (request i gets seed * 1_000_003 + i) and the PIT's randomisation."""
    alpha: float = 1e-3
    """Level: the run fails when the combined p-value is below it."""
    prompts: str = "auto"
    """auto (held-out ShareGPT first turns if downloaded, else built-in), sharegpt or builtin."""
    num_prompts: int = 64
    """Distinct prompts; requests cycle through them with different seeds."""
    max_prompt_tokens: int = 128
    """Prompts are cut to their last this many tokens."""

    def sampling_fields(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty, "logit_bias": self.logit_bias,
                "structured": self.structured,
                "sampler": self.sampler}

    def __post_init__(self):
        from specdecode.sampling import SamplingParams

        if self.temperature <= 0:
            raise ConfigError("certify tests sampling: give --temperature > 0 (greedy speculation is checked by "
                              "comparing with plain greedy decoding)")
        SamplingParams(**self.sampling_fields())  # validates them
        for name in ("samples", "max_tokens", "num_prompts", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.samples < 2:
            raise ConfigError("--samples must be at least 2")
        if not 0 < self.alpha < 1:
            raise ConfigError(f"alpha must be in (0, 1), got {self.alpha!r}")


@dataclasses.dataclass
class CertifyReport:
    """A run's outcome: the verdict, what was sampled, and how speculation behaved while it was."""

    verdict: Verdict
    config: CertifyConfig
    model: str
    speculative_config: dict | None
    prompt_source: str
    requests: int
    draft_tokens: int
    accepted_tokens: int
    steps: int
    pit_histogram: list[int]
    """Counts of the PITs in 20 equal bins of [0, 1] (flat under the null)."""
    sample_seconds: float
    check_seconds: float

    def to_json(self) -> dict:
        body = dataclasses.asdict(self)
        body["verdict"] = {**dataclasses.asdict(self.verdict), "passed": self.verdict.passed}
        return body

    def summary(self) -> str:
        v = self.verdict
        spec = self.speculative_config or {"method": "none"}
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        lines = [
            f"certify {self.model} with {spec.get('method')} (T={self.config.temperature:g}, "
            f"top_p={self.config.top_p:g}, top_k={self.config.top_k}, min_p={self.config.min_p:g}, "
            f"{self.config.sampler} sampler): {v.n} tokens "
            f"from {self.requests} requests ({self.prompt_source} prompts), {self.draft_tokens} draft tokens, "
            f"{rate:.1%} accepted",
            f"  PIT uniformity (Kolmogorov-Smirnov): p = {v.pit_ks_p:.3g} (mean PIT {v.pit_mean:.4f}, 0.5 expected)",
            f"  mean p(emitted) vs sum(p^2):         p = {v.mean_p_p:.3g} (z = {v.mean_p_z:+.2f})",
            f"  ranks of the emitted tokens:         p = {v.rank_p:.3g} (chi-square {v.rank_chi2:.1f}; 1st, 2nd, ... "
            f"observed {v.rank_observed[:4]}, expected {[round(e) for e in v.rank_expected[:4]]})",
            f"  repeats of the previous token:       p = {v.repeat_p:.3g} (z = {v.repeat_z:+.2f})",
        ]
        if v.impossible:
            lines.append(f"  tokens the target gives probability 0: {v.impossible}")
        lines.append(f"  combined (Bonferroni): p = {v.p_value:.3g} -> {'PASS' if v.passed else 'FAIL'} "
                     f"at alpha = {v.alpha:g}")
        return "\n".join(lines)


def certify(llm, config: CertifyConfig, reference=None) -> CertifyReport:
    """Sample config.samples tokens from `llm` (its speculative config as given) and test them against `reference`
    (default: the llm's own target weights when float32, else the checkpoint loaded again in float32)."""
    import numpy as np
    import torch

    from specdecode.certify.prompts import prompt_ids, prompt_texts
    from specdecode.certify.stats import PositionStats, verdict
    from specdecode.sampling import SamplingParams

    texts, source = prompt_texts(config.prompts, config.num_prompts)
    prompts = prompt_ids(llm.tokenizer, texts, min(config.max_prompt_tokens, llm.max_model_len - config.max_tokens - 1))
    requests = math.ceil(config.samples / config.max_tokens)
    params = [SamplingParams(max_tokens=config.max_tokens, seed=config.seed * 1_000_003 + i, ignore_eos=True,
                             **config.sampling_fields())
              for i in range(requests)]
    inputs = [prompts[i % len(prompts)] for i in range(requests)]
    before = dataclasses.replace(llm.total_stats)
    start = time.perf_counter()
    outputs = llm.generate(inputs, params)
    sampled = time.perf_counter()
    stats = llm.total_stats
    if reference is None:
        reference = llm.target if llm.target.dtype == torch.float32 else _float32_target(llm)
    generator = torch.Generator().manual_seed(config.seed + 0x5EED)
    parts = []
    for first in range(len(prompts)):  # requests of one prompt share its prefill
        answers = [out.outputs[0].token_ids for out in outputs[first::len(prompts)]]
        if answers:
            parts += _recompute(reference, prompts[first], answers, params[0], generator, llm.tokenizer)
    checked = time.perf_counter()
    positions = PositionStats.concat(parts)
    spec = llm.spec_config
    return CertifyReport(
        verdict(positions, config.alpha), config, llm.model_name,
        dataclasses.asdict(spec) if spec is not None else None, source, requests,
        stats.draft_tokens - before.draft_tokens, stats.accepted_tokens - before.accepted_tokens,
        stats.steps - before.steps, np.histogram(positions.pit, bins=20, range=(0.0, 1.0))[0].tolist(),
        sampled - start, checked - sampled)


def _float32_target(llm):
    from specdecode.model.loading import load_model

    return load_model(llm.model_dir, dtype="float32", device=llm.device)


def _recompute(reference, prompt: list[int], answers: list[list[int]], params: SamplingParams,
               generator: torch.Generator, tokenizer=None) -> list[PositionStats]:
    """The reference's processed distribution before each generated token of each answer to one prompt (the prompt
    through the cache once, then each answer causally after it: the same numbers as one forward over prompt +
    answer), and the tests' per-position statistics."""
    import torch

    from specdecode.certify.stats import position_stats
    from specdecode.sampling import params_tensors, penalize, processed_probs
    from specdecode.speculation.grammar import Grammar

    with torch.inference_mode():
        device = reference.device
        cache = reference.make_cache(1, len(prompt) + max(map(len, answers)))
        slot = torch.tensor([0])
        out = reference(torch.tensor([prompt], device=device), cache=cache, slots=slot, compute_logits=False)
        last = out.hidden[0, -1:]  # [1, D]: predicts each answer's first token
        cache.advance(slot, len(prompt))
        parts = []
        for answer in answers:
            # The cache's length stays at the prompt: each answer overwrites the one before.
            if len(answer) > 1:
                hidden = reference(torch.tensor([answer[:-1]], device=device), cache=cache, slots=slot,
                                   compute_logits=False).hidden[0]  # [G - 1, D]
                hidden = torch.cat([last, hidden])
            else:
                hidden = last
            logits = reference.lm_head(hidden).float()  # [G, V]
            G = len(answer)
            if params.penalized:  # position g follows prompt + answer[:g]
                logits = penalize(logits, params, list(prompt), [], [list(answer[:g]) for g in range(G)])
            if params.structured is not None:  # the grammar's mask after answer[:g]
                masks = Grammar(params.structured, tokenizer, logits.shape[-1]).tree_masks(
                    [list(answer[:g]) for g in range(G)])
                logits = logits.masked_fill(~masks.to(logits.device), float("-inf"))
            p = processed_probs(logits, *params_tensors([params], [G], device=logits.device)).cpu()  # [G, V]
            parts.append(position_stats(p, torch.tensor(answer), generator))
        return parts
