"""The statistics of the losslessness certificate: per emitted token, the target's processed distribution p given the
token's prefix -> a randomised probability integral transform (PIT), p(emitted token) and its rank; then a uniformity
test of the PITs, a z-test of the mean of p(emitted) against its expectation sum(p^2), a chi-square test of the
ranks and a z-test of how often a token repeats the one before it against sum p(previous token), combined by
Bonferroni.

Under the null (every token is drawn from p given its prefix) each PIT is U(0,1) given everything before it, so the
PITs of a run are iid U(0,1) (docs/certify.md). Tokens are ordered by decreasing p (ties by id) for the PIT, so a
bias toward likely tokens - what drafted tokens usually are - moves the PITs toward 0.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch


@dataclasses.dataclass
class PositionStats:
    """What the tests need from a batch of emitted positions (numpy float64 arrays [N])."""

    pit: np.ndarray
    """Randomised PIT: F(x-) + v * p(x), with F the cumulative mass in decreasing-p order and v ~ U(0,1)."""
    p_emitted: np.ndarray
    """p(x): the target's processed probability of the emitted token."""
    expected: np.ndarray
    """sum(p^2): the mean of p(x) when x ~ p."""
    variance: np.ndarray
    """sum(p^3) - sum(p^2)^2: the variance of p(x) when x ~ p."""
    rank: np.ndarray
    """Rank of x in the order (0 = the most likely token)."""
    top: np.ndarray
    """[N, RANKS] the RANKS largest probabilities, in decreasing order."""
    p_previous: np.ndarray
    """p(the token emitted just before this one) at this position (0 at an answer's first token)."""
    repeated: np.ndarray
    """1 where this token equals the one emitted just before it, else 0."""

    @classmethod
    def concat(cls, parts: list["PositionStats"]) -> "PositionStats":
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(cls)))

    def __len__(self) -> int:
        return len(self.pit)


RANKS = 8
"""The rank test's categories: each of the RANKS most likely tokens, and the rest."""


def position_stats(p: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator) -> PositionStats:
    """p [N, V]: processed target probabilities (rows sum to 1); tokens [N]: the emitted tokens; generator: the
    source of the PIT's randomisation (independent of the engine's)."""
    p = p.double()
    rows = torch.arange(len(tokens))
    p_x = p[rows, tokens]  # [N]
    ids = torch.arange(p.shape[1])
    # Mass strictly before x in the order (decreasing p, then increasing id).
    before = (p > p_x[:, None]) | ((p == p_x[:, None]) & (ids[None, :] < tokens[:, None]))  # [N, V]
    mass_before = (p * before).sum(-1)
    v = torch.rand(len(tokens), generator=generator, dtype=torch.float64)
    pit = (mass_before + v * p_x).clamp(0.0, 1.0)
    s2 = (p * p).sum(-1)
    s3 = (p * p * p).sum(-1)
    top = p.topk(min(RANKS, p.shape[1]), dim=-1).values  # [N, R]
    previous = torch.cat([tokens.new_full((1,), -1), tokens[:-1]])  # [N]: one answer's tokens in order
    p_previous = torch.where(previous >= 0, p[rows, previous.clamp(min=0)], 0.0)
    repeated = (tokens == previous).double()
    return PositionStats(pit.numpy(), p_x.numpy(), s2.numpy(), (s3 - s2 * s2).clamp(min=0.0).numpy(),
                         before.sum(-1).numpy(), top.numpy(), p_previous.numpy(), repeated.numpy())


@dataclasses.dataclass
class Verdict:
    """The tests' outcome."""

    n: int
    """Emitted positions tested."""
    pit_ks_p: float
    """p-value of the Kolmogorov-Smirnov test that the PITs are U(0,1)."""
    pit_mean: float
    """Mean PIT (0.5 under the null; lower = biased toward likely tokens)."""
    mean_p_z: float
    """z of the mean of p(emitted) against sum(p^2) (> 0 = biased toward likely tokens)."""
    mean_p_p: float
    """Two-sided p-value of that z."""
    rank_chi2: float
    """Chi-square of the counts of emitted tokens by rank (1st, 2nd, ... RANKS-th most likely, the rest) against
    their expectations, with the covariance the per-position distributions give."""
    rank_p: float
    """Its p-value."""
    rank_observed: list[int]
    """Emitted tokens of each rank category."""
    rank_expected: list[float]
    """Their expectations under the null."""
    repeat_z: float
    """z of the count of tokens equal to the token before them against sum p(previous token) (> 0 = too many
    repeats: what a sampler whose noise leaks from one position to the next produces)."""
    repeat_p: float
    """Two-sided p-value of that z."""
    impossible: int
    """Emitted tokens to which the recomputed distribution gives probability 0."""
    p_value: float
    """Bonferroni combination: min(1, 4 * the smallest of the four p-values); 0 when too many tokens were
    impossible."""
    alpha: float
    """The level: the run passes when p_value >= alpha."""

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha


IMPOSSIBLE_FRACTION = 1e-3
"""Emitted tokens with recomputed probability 0 tolerated (a top-p/top-k boundary can move with the last bits of a
logit between the engine's pass and the reference's); more fail the run outright."""


def verdict(s: PositionStats, alpha: float = 1e-3) -> Verdict:
    from scipy import stats as scipy_stats  # here, not at the top: scipy takes ~1 s to import

    if len(s) < 2:
        raise ValueError("certify needs at least two emitted tokens")
    ks = scipy_stats.kstest(s.pit, "uniform")
    total_var = float(s.variance.sum())
    excess = float((s.p_emitted - s.expected).sum())
    z = excess / math.sqrt(total_var) if total_var > 0 else 0.0
    z_p = float(2 * scipy_stats.norm.sf(abs(z)))
    chi2, rank_p, observed, expected = rank_test(s)
    repeat_var = float((s.p_previous * (1 - s.p_previous)).sum())
    repeat_z = float((s.repeated - s.p_previous).sum()) / math.sqrt(repeat_var) if repeat_var > 0 else 0.0
    repeat_p = float(2 * scipy_stats.norm.sf(abs(repeat_z)))
    impossible = int((s.p_emitted <= 0).sum())
    combined = min(1.0, 4 * min(float(ks.pvalue), z_p, rank_p, repeat_p))
    if impossible > IMPOSSIBLE_FRACTION * len(s):
        combined = 0.0
    return Verdict(len(s), float(ks.pvalue), float(s.pit.mean()), z, z_p, chi2, rank_p, observed, expected,
                   repeat_z, repeat_p, impossible, combined, alpha)


def rank_test(s: PositionStats) -> tuple[float, float, list[int], list[float]]:
    """Emitted tokens counted by rank category against the expected counts sum_i pi_i. Each position adds a one-hot
    draw from its own pi_i, so under the null O - E is a sum of independent increments with covariance
    sum_i diag(pi_i) - pi_i pi_i^T; (O - E) C^-1 (O - E) over all categories but one is chi-square."""
    from scipy import stats as scipy_stats

    R = s.top.shape[1]
    pi = np.concatenate([s.top, np.clip(1.0 - s.top.sum(1, keepdims=True), 0.0, None)], axis=1)  # [N, R + 1]
    category = np.minimum(s.rank, R)
    observed = np.bincount(category, minlength=R + 1).astype(np.float64)
    expected = pi.sum(0)
    covariance = np.diag(expected) - pi.T @ pi  # [R + 1, R + 1]
    keep = [c for c in range(R) if expected[c] > 1e-9]  # categories that can occur (the last one is implied)
    diff = (observed - expected)[keep]
    chi2 = float(diff @ np.linalg.lstsq(covariance[np.ix_(keep, keep)], diff, rcond=None)[0])
    dof = np.linalg.matrix_rank(covariance[np.ix_(keep, keep)])
    p = float(scipy_stats.chi2.sf(chi2, dof)) if dof > 0 else 1.0
    return chi2, p, observed.astype(int).tolist(), expected.tolist()
