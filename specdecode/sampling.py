"""Sampling parameters and logits -> processed probabilities (temperature, top-k, top-p).

Plain decoding, the draft proposers and the verifier all call `processed_probs`, so the distribution the
verifier preserves is exactly the one plain sampling draws from.
"""
from __future__ import annotations

import dataclasses

import torch

from specdecode.errors import ConfigError


@dataclasses.dataclass
class SamplingParams:
    """Per-request decoding parameters, with vLLM's names and defaults."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p; 1 keeps all."""
    max_tokens: int = 16
    """Most tokens to generate."""
    stop: list[str] | str | None = None
    """Strings that end generation; the stop string itself is not returned."""
    seed: int | None = None
    """Seed of this request's random generator (same seed, same output)."""
    ignore_eos: bool = False
    """Keep generating after an end-of-sequence token (benchmarks use it for fixed-length outputs)."""
    use_speculation: bool = True
    """Set False to decode this request without speculation."""

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ConfigError(f"top_k must be a non-negative integer (0 or -1 = off), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ConfigError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, per row.

    logits [N, V]; temperature, top_k, top_p [N] (temperature 0 = one-hot argmax; top_k <= 0 = off).
    Returns [N, V] float32 rows that sum to 1.
    """
    logits = logits.float()
    N, V = logits.shape
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(V, device=logits.device)
    k = torch.where(top_k > 0, top_k, V)
    drop = rank[None, :] >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = sorted_logits.softmax(-1)
    # Keep a token while the mass before it is below top_p: the most likely token is always kept.
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop = mass_before >= top_p[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    if greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def params_tensors(params: list[SamplingParams], repeats: list[int] | None = None,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """temperature, top_k, top_p tensors with each request's values repeated `repeats[i]` times."""
    repeats = repeats or [1] * len(params)
    temperature = torch.tensor([p.temperature for p, r in zip(params, repeats) for _ in range(r)], device=device)
    top_k = torch.tensor([p.top_k for p, r in zip(params, repeats) for _ in range(r)], device=device)
    top_p = torch.tensor([p.top_p for p, r in zip(params, repeats) for _ in range(r)], device=device)
    return temperature.float(), top_k.long(), top_p.float()


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: probs [N, V] (rows need not be normalised), u [N] uniforms in [0, 1) -> tokens [N].

    The first index whose cumulative mass exceeds u * total is never a zero-probability token.
    """
    cdf = probs.double().cumsum(-1)  # [N, V]
    target = u.to(cdf) * cdf[:, -1]
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def sample_from(probs: torch.Tensor, u: float) -> int:
    """One inverse-CDF draw from probs [V]."""
    return int(sample_rows(probs[None], torch.tensor([u]))[0])
