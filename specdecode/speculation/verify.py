"""The one verifier: target probabilities at every tree node + the draft tree -> accepted path + next token.

Node 0 of the target's rows is the root (the last committed token, whose distribution proposes the tree's
first level); row i + 1 belongs to tree node i. Greedy walks down the target's argmax. Sampling is lossless:
at each node the children are tried in order with the multi-draft rule of SpecInfer (for one child it is the
Leviathan/Chen rule): child x drawn from q is accepted with probability min(1, p(x)/q(x)); on rejection
p <- norm(max(0, p - q)) and the next child is tried; if every child is rejected the next token is drawn from
what is left of p; at a leaf the bonus token is drawn from p. One-hot drafts (draft_probs None) have q = onehot(x),
so rejection zeroes p(x). p and q must already be processed (temperature, top-k, top-p).
"""
from __future__ import annotations

import dataclasses

import torch

from specdecode.sampling import StepUniforms, sample_from, sample_rows
from specdecode.speculation.tree import DraftTree


@dataclasses.dataclass
class VerifyResult:
    accepted: list[int]
    """Tree node indices of the accepted path, root to leaf (possibly empty)."""
    next_token: int
    """The target's own token after the accepted path: the correction, or the bonus when all was accepted."""


def verify_greedy(tree: DraftTree, target_argmax: list[int]) -> VerifyResult:
    """target_argmax [n + 1]: the target's argmax at the root and at every node."""
    children = tree.shape.children
    tokens = tree.tokens.tolist()
    accepted: list[int] = []
    node = -1
    while True:
        want = target_argmax[node + 1]
        match = next((c for c in children[node + 1] if tokens[c] == want), None)
        if match is None:
            return VerifyResult(accepted, want)
        accepted.append(match)
        node = match


def verify_sampling(tree: DraftTree, p_all: torch.Tensor, uniforms: StepUniforms) -> VerifyResult:
    """p_all [n + 1, V]: target probabilities at the root and at every node. uniforms: the request's numbers for
    this step; the i-th child tried at depth d uses uniforms.accept(d, i), the token drawn at depth d
    uniforms.draw(d), so the decisions about an output position never depend on the rest of the batch."""
    children = tree.shape.children
    tokens = tree.tokens.tolist()
    q_all = None if tree.draft_probs is None else tree.draft_probs.to(p_all.device)
    accepted: list[int] = []
    node = -1
    while True:
        p = p_all[node + 1]
        depth = len(accepted)
        for tried, child in enumerate(children[node + 1]):
            x = tokens[child]
            q_x = 1.0 if q_all is None else float(q_all[child, x])
            # u < p(x) / q(x)  <=>  accept with probability min(1, p(x) / q(x)).
            if uniforms.accept(depth, tried) * q_x < float(p[x]):
                accepted.append(child)
                node = child
                break
            if q_all is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = (p - q_all[child]).clamp_(min=0.0)
            total = float(residual.sum())
            if total <= 0.0:  # only when p == q up to rounding; then rejection had probability zero
                residual = p
                total = float(residual.sum())
            p = residual / total
        else:
            return VerifyResult(accepted, sample_from(p, uniforms.draw(depth)))


def verify_chains(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, lengths: torch.Tensor,
                  u_accept: torch.Tensor, u_draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Leviathan/Chen rule for a batch of chains at once (the same decisions as verify_sampling on a chain,
    given the same uniforms).

    p [B, K+1, V]: target probabilities at the root and after each draft token; q [B, K, V]: the draft's, or None
    for one-hot drafts; tokens [B, K]; lengths [B]: each row's real chain length (<= K, the rest is padding);
    u_accept [B, K]: the uniform accepting draft d; u_draw [B, K+1]: the uniform drawing the token at depth d (only
    the one at the first rejection, or the bonus at depth lengths, is used). Returns n_matches [B] (accepted draft
    tokens) and next_token [B].
    """
    B, K = tokens.shape
    rows = torch.arange(B, device=p.device)
    p_x = p[:, :K].gather(2, tokens[..., None]).squeeze(-1)  # [B, K]
    q_x = torch.ones_like(p_x) if q is None else q.gather(2, tokens[..., None]).squeeze(-1)
    real = torch.arange(K, device=p.device)[None, :] < lengths[:, None]
    accept = (u_accept * q_x < p_x) & real  # u < p(x) / q(x)
    n_matches = accept.long().cumprod(dim=1).sum(dim=1)  # [B]: the first rejection ends the chain
    p_next = p[rows, n_matches]  # [B, V]
    rejected = n_matches < lengths
    at = n_matches.clamp(max=max(K - 1, 0))
    if K == 0:
        residual = p_next
    elif q is None:
        residual = p_next.scatter(1, tokens[rows, at][:, None], 0.0)
    else:
        residual = (p_next - q[rows, at]).clamp(min=0.0)
    # A residual with no mass only arises when p == q up to rounding, where rejection had probability zero.
    use_residual = rejected & (residual.sum(-1) > 0)
    dist = torch.where(use_residual[:, None], residual, p_next)
    return n_matches, sample_rows(dist, u_draw[rows, n_matches])
