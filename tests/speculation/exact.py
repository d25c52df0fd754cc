"""Exact output distributions of the verifiers, without sampling: random target and draft tables over a tiny
vocabulary, and integration over the uniforms the verifier reads.

A verifier's output is a piecewise-constant function of its uniforms: an accept uniform matters only through which
side of a threshold r(x) / q(x) it falls, a draw uniform only through which cumulative-mass interval of the
distribution it is drawn from. Cutting [0, 1) at a superset of those breakpoints (the thresholds and masses of
every residual the rule can reach, plus those of p itself and of un-renormalised residuals, which some wrong
verifiers use) leaves cells on which the output is constant; evaluating the verifier once per cell at its
midpoint and weighting by the cell's width integrates exactly (up to float rounding). A verifier whose
breakpoints fall elsewhere is only approximated, which is enough to show that it is wrong.
"""
from __future__ import annotations

import itertools
import random
from collections import defaultdict

import torch

V = 3


class Table:
    """A random conditional distribution over V tokens for every prefix (a tuple of tokens), some of them with
    zero-probability tokens, as top-k or top-p leave them."""

    def __init__(self, name: str):
        self.name = name
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self.cache:
            rng = random.Random(f"{self.name}:{prefix}")
            weights = [rng.random() ** 2 + 0.02 for _ in range(V)]
            if rng.random() < 0.35:
                weights[rng.randrange(V)] = 0.0
            total = sum(weights)
            self.cache[prefix] = torch.tensor([w / total for w in weights], dtype=torch.float64)
        return self.cache[prefix]

    def argsort(self, prefix: tuple[int, ...]) -> list[int]:
        """Tokens from the most to the least likely (a deterministic drafter's guesses)."""
        return torch.argsort(self(prefix), descending=True, stable=True).tolist()


def target_joint(p: Table, prefix: tuple[int, ...], length: int) -> dict[tuple[int, ...], float]:
    """The target's exact distribution of the next `length` tokens after prefix."""
    out = {}
    for seq in itertools.product(range(V), repeat=length):
        prob = 1.0
        for t in range(length):
            prob *= float(p(prefix + seq[:t])[seq[t]])
        out[seq] = prob
    return out


def continue_with_target(step: dict[tuple[int, ...], float], p: Table, prefix: tuple[int, ...],
                         length: int) -> dict[tuple[int, ...], float]:
    """Tokens emitted by one step (variable length), continued by exact target sampling to `length` tokens."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    for emitted, weight in step.items():
        emitted = emitted[:length]
        for rest, prob in target_joint(p, prefix + emitted, length - len(emitted)).items():
            out[emitted + rest] += weight * prob
    return out


def max_error(got: dict, want: dict) -> float:
    return max(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in set(got) | set(want))


# -- cells --------------------------------------------------------------------------------------------------------


def cells(breakpoints) -> list[tuple[float, float]]:
    """(midpoint, width) of the intervals [0, 1) is cut into at the given points."""
    cuts = sorted({0.0, 1.0} | {float(b) for b in breakpoints if 0.0 < float(b) < 1.0})
    return [((a + b) / 2, b - a) for a, b in zip(cuts, cuts[1:]) if b - a > 0]


def mass_cuts(dist: torch.Tensor) -> list[float]:
    """Where an inverse-CDF draw from dist (normalised or not) changes token."""
    total = float(dist.sum())
    return (dist.cumsum(0) / total).tolist()[:-1] if total > 0 else []


def residual_stages(p: torch.Tensor, drafts: list[tuple[int, torch.Tensor | None]], normalise: bool):
    """The distributions a node's rule walks through: p, then after rejecting each draft (token, q) in turn
    (q None = one-hot). Yields (distribution before the draft, draft) and finally (what is left, None)."""
    r = p
    for x, q in drafts:
        yield r, (x, q)
        if q is None:
            nxt = r.clone()
            nxt[x] = 0.0
        else:
            nxt = (r - q).clamp(min=0.0)
        if float(nxt.sum()) <= 0:
            nxt = r
        r = nxt / nxt.sum() if normalise else nxt
    yield r, None


def node_breakpoints(p: torch.Tensor, drafts: list[tuple[int, torch.Tensor | None]]):
    """(accept thresholds per draft index, draw cuts) of one node whose children are `drafts`, over the correct
    walk and the un-renormalised one."""
    accept: dict[int, set[float]] = defaultdict(set)
    draw: set[float] = set(mass_cuts(p))
    for normalise in (True, False):
        for i, (r, draft) in enumerate(residual_stages(p, drafts, normalise)):
            draw.update(mass_cuts(r))
            if draft is not None:
                x, q = draft
                q_x = 1.0 if q is None else float(q[x])
                if q_x > 0:
                    accept[i].add(float(r[x]) / q_x)
                    accept[i].add(float(p[x]) / q_x)
    return accept, draw
