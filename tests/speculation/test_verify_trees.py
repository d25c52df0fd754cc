"""verify_trees (every sampled tree of a step at once, on tensors) takes exactly the decisions of verify_sampling (one
tree, node by node, which tests/speculation/test_verify_exact.py proves exact by enumeration), given the same
uniforms: on random trees, sampled and one-hot drafts, peaked and flat target rows, rows truncated by top-k."""
import random

import pytest
import torch

from specdecode.speculation.tree import DraftTree
from specdecode.speculation.verify import verify_sampling, verify_trees

from .heads_fixtures import TableUniforms

V = 12


def random_tree(rng: random.Random, gen: torch.Generator, n: int, sampled: bool, p_rows):
    parents = [-1]
    for i in range(1, n):
        parents.append(rng.randrange(-1, i))
    tokens = torch.randint(0, V, (n,), generator=gen)
    q = None
    if sampled:
        q = torch.softmax(torch.randn(n, V, generator=gen) * 2, -1)
        tokens = torch.multinomial(q, 1, generator=gen).squeeze(1)
    else:  # one-hot drafts: often the target's likely tokens, so that some are accepted
        likely = p_rows[torch.tensor([p + 1 for p in parents])].argmax(-1)
        tokens = torch.where(torch.rand(n, generator=gen) < 0.6, likely, tokens)
    return DraftTree(tokens=tokens, parents=tuple(parents), draft_probs=q)


def pack(trees, p_list):
    """The tensors verify_trees takes, from trees of different sizes (padded)."""
    B, N = len(trees), max(len(t) for t in trees)
    depth = max(int(t.depths.max()) + 1 for t in trees)
    C = max(max(len(c) for c in t.shape.children) for t in trees)
    p = torch.zeros(B, N + 1, V)
    tokens = torch.zeros(B, N, dtype=torch.long)
    children = torch.full((B, N + 1, C), -1, dtype=torch.long)
    q = None if all(t.draft_probs is None for t in trees) else torch.zeros(B, N, V)
    for b, (t, rows) in enumerate(zip(trees, p_list)):
        n = len(t)
        p[b, :n + 1] = rows
        tokens[b, :n] = t.tokens
        for node, kids in enumerate(t.shape.children):
            children[b, node, :len(kids)] = torch.tensor(kids, dtype=torch.long)
        if q is not None:
            q[b, :n] = t.draft_probs if t.draft_probs is not None else torch.nn.functional.one_hot(t.tokens, V).float()
    return p, q, tokens, children, depth + 1, C


@pytest.mark.parametrize("sampled", [True, False, None])  # None: either, per tree
def test_verify_trees_takes_the_decisions_of_verify_sampling(sampled):
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    agreed = accepted_any = 0
    for trial in range(60):
        trees, p_list = [], []
        for _ in range(rng.randint(1, 5)):
            n = rng.randint(1, 7)
            logits = torch.randn(n + 1, V, generator=gen) * rng.choice([0.5, 2.0, 5.0])
            rows = torch.softmax(logits, -1)
            if rng.random() < 0.3:  # a top-k'd row: zeros outside the 3 most likely
                keep = rows.topk(3, -1).indices
                rows = torch.zeros_like(rows).scatter(1, keep, rows.gather(1, keep))
                rows = rows / rows.sum(-1, keepdim=True)
            trees.append(random_tree(rng, gen, n, rng.random() < 0.5 if sampled is None else sampled, rows))
            p_list.append(rows)
        p, q, tokens, children, D, C = pack(trees, p_list)
        u_accept = torch.rand(len(trees), D, C, generator=gen, dtype=torch.float64)
        u_draw = torch.rand(len(trees), D, generator=gen, dtype=torch.float64)
        accepted, next_token = verify_trees(p, q, tokens, children, u_accept, u_draw)
        for b, tree in enumerate(trees):
            want = verify_sampling(tree, p_list[b], TableUniforms(u_accept[b], u_draw[b]))
            got = [int(x) for x in accepted[b] if x >= 0]
            assert (got, int(next_token[b])) == (want.accepted, want.next_token), (trial, b)
            agreed += 1
            accepted_any += bool(want.accepted)
    assert agreed > 100 and accepted_any > 20  # the comparison saw real accepted paths
