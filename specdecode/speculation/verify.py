"""The one verifier: target probabilities at every tree node + the draft tree -> accepted path + next token.

Words used here and in the step loop: the *draft tokens* are a tree's nodes; the *accepted* tokens are the nodes
of the path the verifier keeps, root to leaf; the *next token* is the target's own token after that path, either
a *recovered* (correction) token drawn where a draft was rejected or the *bonus* token drawn after a leaf whose
whole path was accepted; a step's *output tokens* are the accepted tokens and then the next token.

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

from specdecode.sampling import (ACCEPT, DRAW, SamplingParams, StepUniforms, params_tensors, position_uniforms,
                                 processed_probs, race_tokens, raced, sample_from, sample_rows)
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


def verify_trees(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, children: torch.Tensor,
                 u_accept: torch.Tensor, u_draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule of verify_sampling for a batch of trees at once, level by level on tensors: the same decisions
    given the same uniforms, and nothing read back to the host.

    p [B, N+1, V]: target probabilities at the root and at every node; q [B, N, V]: the draft's at every node, or
    None for one-hot drafts; tokens [B, N]; children [B, N+1, C]: children[b, n, i] is the i-th child of node n - 1
    (n = 0: the root), -1 past the last; u_accept [B, D, C]: the uniform accepting the i-th child tried at depth d;
    u_draw [B, D]: the uniform drawing the token at depth d (D = the deepest tree's depth + 1). Returns accepted
    [B, D] (node indices of the accepted path, -1 past its end) and next_token [B].
    """
    B, _, V = p.shape
    D, C = u_draw.shape[1], children.shape[2]
    rows = torch.arange(B, device=p.device)
    cur = torch.zeros(B, dtype=torch.long, device=p.device)  # the row of p of the node reached (0: the root)
    dist = p[:, 0]  # [B, V]: p at that node, less the children rejected so far
    walking = torch.ones(B, dtype=torch.bool, device=p.device)
    accepted = torch.full((B, D), -1, dtype=torch.long, device=p.device)
    next_token = torch.zeros(B, dtype=torch.long, device=p.device)
    for depth in range(D):
        moved = torch.zeros(B, dtype=torch.bool, device=p.device)
        for tried in range(C):
            child = children[rows, cur, tried]  # [B]
            trying = walking & ~moved & (child >= 0)
            node = child.clamp(min=0)
            x = tokens[rows, node]
            p_x = dist.gather(1, x[:, None]).squeeze(1)
            q_x = torch.ones_like(p_x) if q is None else q[rows, node, x]
            accept = trying & (u_accept[:, depth, tried] * q_x.double() < p_x.double())  # u < p(x) / q(x)
            reject = trying & ~accept
            if q is None:
                residual = dist.scatter(1, x[:, None], 0.0)
            else:
                residual = (dist - q[rows, node]).clamp(min=0.0)
            total = residual.sum(-1, keepdim=True)
            # A residual with no mass only arises when p == q up to rounding, where rejection had probability zero.
            residual = torch.where(total > 0, residual / total, dist / dist.sum(-1, keepdim=True))
            dist = torch.where(reject[:, None], residual, dist)
            accepted[:, depth] = torch.where(accept, child, accepted[:, depth])
            cur = torch.where(accept, child + 1, cur)
            moved |= accept
        ending = walking & ~moved  # every child rejected, or a leaf reached: draw the correction or the bonus
        next_token = torch.where(ending, sample_rows(dist, u_draw[:, depth]), next_token)
        walking &= moved
        dist = torch.where(moved[:, None], p[rows, cur], dist)
    return accepted, next_token


def race_positions(tree: DraftTree, start: int) -> list[int]:
    """The output position whose race decides the target's token at the root and at each node: a node at depth d
    (0: a child of the root) guesses position start + d, and the target's token after it is position start + d + 1."""
    return [start] + (tree.depths + start + 1).tolist()


def verify_step(trees: list[DraftTree], logits: torch.Tensor, params: list[SamplingParams], keys: list[int],
                starts: list[int]) -> list[VerifyResult]:
    """Every row of one step's target pass at once. logits [B, W, V] at [root, nodes..., lookahead nodes...] of each
    row; params, keys (RequestRandom.key) and starts (the output position of each row's first new token) per row.
    Greedy rows follow the target's argmax; sampled chains and trees take the lossless rule on tensors; the
    results, and each lookahead branch's argmax (set on the branch), come to the host in one transfer."""
    B, V = len(trees), logits.shape[2]
    device = logits.device
    sampled = [b for b in range(B) if not params[b].greedy]
    read = [b for b in range(B) if params[b].greedy or trees[b].lookahead is not None]
    parts: list[torch.Tensor] = []  # everything the host needs, flattened: one transfer at the end
    if read:
        rows = logits if len(read) == B else logits[read]  # indexing by a list would copy the logits
        parts.append(rows.argmax(-1).flatten())  # [R * W]
    racing = [b for b in sampled if raced(params[b])]
    chains = [b for b in sampled if trees[b].shape.is_chain and b not in racing]
    branching = [b for b in sampled if not trees[b].shape.is_chain and b not in racing]
    if sampled:
        W = 1 + max(len(trees[b]) for b in sampled)  # draft nodes only
        p = processed_probs(logits[sampled, :W].reshape(-1, V),
                            *params_tensors([params[b] for b in sampled], [W] * len(sampled), device=device))
        p = p.view(len(sampled), W, V)
        row_of = {b: row for row, b in enumerate(sampled)}
        if racing:  # the target's own token at the root and at every node: the winner of that position's race
            rows = torch.cat([p[row_of[b], :1 + len(trees[b])] for b in racing])
            race_keys = [keys[b] for b in racing for _ in range(1 + len(trees[b]))]
            positions = [p for b in racing for p in race_positions(trees[b], starts[b])]
            parts.append(race_tokens(rows, race_keys, positions).to(device))
        if chains:
            parts.extend(_chains([trees[b] for b in chains], p[[row_of[b] for b in chains]],
                                 [keys[b] for b in chains], [starts[b] for b in chains]))
        if branching:
            tree_parts = _trees([trees[b] for b in branching], p[[row_of[b] for b in branching]],
                                [keys[b] for b in branching], [starts[b] for b in branching])
            levels = tree_parts[0].numel() // len(branching)  # D of verify_trees: path slots per row
            parts.extend(tree_parts)
    host = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist() if parts else []  # the one sync
    taken = 0

    def take(n: int) -> list[int]:
        """The next n numbers of the transfer, in the order the parts were added."""
        nonlocal taken
        taken += n
        return host[taken - n:taken]

    results: list[VerifyResult | None] = [None] * B
    for b in read:
        row, tree = take(logits.shape[1]), trees[b]
        if tree.lookahead is not None:
            tree.lookahead.outputs = row[1 + len(tree):1 + tree.pass_size]
        if params[b].greedy:
            results[b] = verify_greedy(tree, row)
    for b in racing:
        results[b] = verify_greedy(trees[b], take(1 + len(trees[b])))
    if chains:
        for b, n, x in zip(chains, take(len(chains)), take(len(chains))):
            results[b] = VerifyResult(list(range(n)), x)
    if branching:
        paths = take(len(branching) * levels)
        for i, (b, x) in enumerate(zip(branching, take(len(branching)))):
            results[b] = VerifyResult([n for n in paths[i * levels:(i + 1) * levels] if n >= 0], x)
    return results


def _draft_q(trees: list[DraftTree], K: int, V: int, device) -> torch.Tensor | None:
    """[R, K, V] the draft distribution at every node (one-hot drafts get q = onehot(x): the same rule as None), or
    None when every tree's drafts are one-hot."""
    if all(t.draft_probs is None for t in trees):
        return None
    q = torch.zeros(len(trees), K, V, device=device)
    for i, t in enumerate(trees):
        if t.draft_probs is not None:
            q[i, :len(t)] = t.draft_probs.to(device)
        else:
            q[i, :len(t)].scatter_(1, t.tokens[:, None].to(device), 1.0)
    return q


def _chains(trees: list[DraftTree], p: torch.Tensor, keys: list[int], starts: list[int]) -> list[torch.Tensor]:
    """Sampled rows whose drafts are chains. p [R, W, V]. Returns [n_matches [R], next_token [R]] (on the device)."""
    K = p.shape[1] - 1
    tokens = torch.zeros(len(trees), K, dtype=torch.long)
    for i, t in enumerate(trees):
        tokens[i, :len(t)] = t.tokens
    lengths = torch.tensor([len(t) for t in trees])
    # Each row's uniforms belong to its own output positions: the batch's widest chain changes nothing.
    u_accept = position_uniforms(keys, starts, K, ACCEPT)  # [R, K]
    u_draw = position_uniforms(keys, starts, K + 1, DRAW)  # [R, K + 1]
    device = p.device
    n_matches, next_token = verify_chains(p, _draft_q(trees, K, p.shape[2], device), tokens.to(device),
                                          lengths.to(device), u_accept.to(device), u_draw.to(device))
    return [n_matches, next_token]


def _trees(trees: list[DraftTree], p: torch.Tensor, keys: list[int], starts: list[int]) -> list[torch.Tensor]:
    """Sampled rows whose drafts branch. p [R, W, V]. Returns [accepted [R * D], next_token [R]] (on the device)."""
    R, W = len(trees), p.shape[1]
    N = W - 1
    D = 1 + max(int(t.depths.max()) + 1 for t in trees)  # levels, and one more for the bonus after a leaf
    C = max(max(len(c) for c in t.shape.children) for t in trees)
    tokens = torch.zeros(R, N, dtype=torch.long)
    children = torch.full((R, W, C), -1, dtype=torch.long)  # [R, W, C]: node n - 1's i-th child (n = 0: the root)
    for i, t in enumerate(trees):
        tokens[i, :len(t)] = t.tokens
        for node, kids in enumerate(t.shape.children):
            if kids:
                children[i, node, :len(kids)] = torch.tensor(kids)
    u_accept = torch.stack([position_uniforms(keys, starts, D, ACCEPT, index=c) for c in range(C)], -1)  # [R, D, C]
    u_draw = position_uniforms(keys, starts, D, DRAW)  # [R, D]
    device = p.device
    accepted, next_token = verify_trees(p, _draft_q(trees, N, p.shape[2], device), tokens.to(device),
                                        children.to(device), u_accept.to(device), u_draw.to(device))
    return [accepted.flatten(), next_token]
