"""The verifiers' exact output distributions equal the target's, for random p and q (model-free).

verify_chains: several speculative steps composed (so bonus tokens and later steps are covered), chains of uneven
lengths padded in one batch, drafts drawn from q or one-hot. verify_sampling: trees that branch at the root and
below it, drafts from q or one-hot (distinct or repeated siblings), continued by exact target sampling. The
integration over the uniforms is in tests/speculation/exact.py.
"""
from __future__ import annotations

import itertools
import random
from collections import defaultdict

import pytest
import torch

from specdecode.sampling import ACCEPT, DRAW, RequestRandom, StepUniforms, sample_rows
from specdecode.speculation.tree import DraftTree, tree_shape
from specdecode.speculation.verify import verify_chains, verify_sampling

from .exact import V, Table, cells, continue_with_target, max_error, node_breakpoints, target_joint

TOLERANCE = 1e-9


# -- chains, several steps ----------------------------------------------------------------------------------------


def chain_drafts(prefix, length, q: Table, one_hot: bool):
    """(draft tokens, probability that the drafter proposes them)."""
    if one_hot:  # a deterministic drafter: the draft table's most likely token, level by level
        x = ()
        for _ in range(length):
            x += (q.argsort(prefix + x)[0],)
        return [(x, 1.0)]
    out = []
    for x in itertools.product(range(V), repeat=length):
        weight = 1.0
        for i in range(length):
            weight *= float(q(prefix + x[:i])[x[i]])
        if weight > 0:
            out.append((x, weight))
    return out


def chain_steps(prefixes, lengths, K, p: Table, q: Table, one_hot: bool, verify=verify_chains):
    """{prefix: {emitted tokens: probability}} of one speculative step after each prefix, all prefixes' chains
    (lengths[prefix] <= K, padded to K) verified in one batch."""
    pad = Table("padding")  # what a verifier must never read
    rows = []  # (prefix, draft, weight, p rows, q rows, u_accept, u_draw)
    for prefix in prefixes:
        L = lengths[prefix]
        for x, weight in chain_drafts(prefix, L, q, one_hot):
            p_rows = [p(prefix + x[:i]) for i in range(L + 1)] + [pad(prefix + x + (i,)) for i in range(K - L)]
            q_rows = [q(prefix + x[:i]) for i in range(L)] + [pad((9,) + prefix + (i,)) for i in range(K - L)]
            accept_cuts, draw_cuts = [], set()
            for i in range(L + 1):
                drafts = [(x[i], None if one_hot else q_rows[i])] if i < L else []
                accept, draw = node_breakpoints(p_rows[i], drafts)
                accept_cuts.append(accept[0])
                draw_cuts |= draw
            for accept_cells in itertools.product(*(cells(c) for c in accept_cuts[:L])):
                for u, width in cells(draw_cuts):
                    cell_weight = width
                    for _, w in accept_cells:
                        cell_weight *= w
                    u_accept = [a for a, _ in accept_cells] + [0.5] * (K - L)
                    rows.append((prefix, x, weight * cell_weight, p_rows, q_rows, u_accept, [u] * (K + 1)))
    p_t = torch.stack([torch.stack(r[3]) for r in rows])  # [N, K + 1, V]
    q_t = None if one_hot else torch.stack([torch.stack(r[4]) for r in rows])  # [N, K, V]
    tokens = torch.tensor([list(r[1]) + [0] * (K - len(r[1])) for r in rows], dtype=torch.long).view(len(rows), K)
    lengths_t = torch.tensor([len(r[1]) for r in rows])
    u_accept = torch.tensor([r[5] for r in rows], dtype=torch.float64).view(len(rows), K)
    u_draw = torch.tensor([r[6] for r in rows], dtype=torch.float64)
    n_matches, next_token = verify(p_t, q_t, tokens, lengths_t, u_accept, u_draw)
    out: dict = defaultdict(lambda: defaultdict(float))
    for (prefix, x, weight, *_), n, y in zip(rows, n_matches.tolist(), next_token.tolist()):
        out[prefix][x[:n] + (y,)] += weight
    return out


def composed(steps, prefix, length) -> dict[tuple[int, ...], float]:
    """Distribution of the next `length` tokens when speculative steps follow one another."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    for emitted, weight in steps[prefix].items():
        if len(emitted) >= length:
            out[emitted[:length]] += weight
        else:
            for rest, w in composed(steps, prefix + emitted, length - len(emitted)).items():
                out[emitted + rest] += weight * w
    return out


def chain_distribution(K, T, one_hot, name, verify=verify_chains, uneven=True):
    p, q = Table(f"p-{name}"), Table(f"q-{name}")
    prefixes = [x for n in range(T) for x in itertools.product(range(V), repeat=n)]
    # The first step drafts the full K (its bonus token is among the first T); later ones vary in length.
    lengths = {x: (random.Random(f"L{name}{x}").randint(0, K) if uneven and x else K) for x in prefixes}
    steps = chain_steps(prefixes, lengths, K, p, q, one_hot, verify)
    return composed(steps, (), T), target_joint(p, (), T)


CHAIN_CASES = {  # name: (K, tokens compared, one-hot drafts)
    "K1_three_tokens_two_steps": (1, 3, False),
    "K2_four_tokens": (2, 4, False),
    "K3_one_hot": (3, 4, True),
    "K2_one_hot": (2, 3, True),
}


@pytest.mark.parametrize("name", list(CHAIN_CASES))
def test_verify_chains_is_exactly_the_target(name):
    K, T, one_hot = CHAIN_CASES[name]
    got, want = chain_distribution(K, T, one_hot, name)
    assert sum(got.values()) == pytest.approx(1.0, abs=TOLERANCE)
    assert max_error(got, want) < TOLERANCE


def test_exact_chain_check_rejects_a_wrong_verifier():
    """Negative control: the bonus token drawn from the row before the right one."""
    def bonus_from_previous_row(p, q, tokens, lengths, u_accept, u_draw):
        n, y = verify_chains(p, q, tokens, lengths, u_accept, u_draw)
        rows = torch.arange(len(n))
        wrong = sample_rows(p[rows, (n - 1).clamp(min=0)], u_draw[rows, n])
        return n, torch.where((n == lengths) & (n > 0), wrong, y)

    got, want = chain_distribution(2, 3, False, "K2_four_tokens", verify=bonus_from_previous_row)
    assert max_error(got, want) > 1e-3


# -- trees --------------------------------------------------------------------------------------------------------


class NeedValue(Exception):
    """The verifier asked for a uniform that has no value yet."""


class Probe(StepUniforms):
    """Uniforms with values only for the keys assigned so far."""

    def __init__(self, assigned: dict):
        self.assigned = assigned

    def _get(self, key):
        if key not in self.assigned:
            raise NeedValue(key)
        return self.assigned[key]

    def accept(self, depth, child):
        return self._get(("accept", depth, child))

    def draw(self, depth):
        return self._get(("draw", depth))


def tree_assignments(parents, prefix, q: Table, drafts: str):
    """(tokens, probability the drafter proposes them). drafts: "q" (each node drawn from q given its path; siblings
    independently), "distinct" (one-hot: the i-th sibling is q's i-th most likely token), "repeated" (one-hot:
    every sibling is q's most likely token)."""
    n = len(parents)
    shape = tree_shape(tuple(parents))

    def context(tokens, node):  # the tokens before `node`
        return prefix + tuple(tokens[a] for a in _ancestors(parents, node))

    if drafts == "q":
        for tokens in itertools.product(range(V), repeat=n):
            weight = 1.0
            for i in range(n):
                weight *= float(q(context(tokens, i))[tokens[i]])
            if weight > 0:
                yield tokens, weight
        return
    tokens = [0] * n
    for i in range(n):  # parents come before children, so contexts are known
        sibling = shape.children[parents[i] + 1].index(i)
        tokens[i] = q.argsort(context(tokens, i))[sibling % V if drafts == "distinct" else 0]
    yield tuple(tokens), 1.0


def _ancestors(parents, node) -> list[int]:
    path = []
    while parents[node] >= 0:
        node = parents[node]
        path.append(node)
    return path[::-1]


def tree_distribution(parents, drafts: str, name: str, verify=verify_sampling, prefix=(1,)):
    p, q = Table(f"p-{name}"), Table(f"q-{name}")
    parents = tuple(parents)
    shape = tree_shape(parents)
    n = len(parents)
    levels = shape.depths.tolist()
    step: dict[tuple[int, ...], float] = defaultdict(float)
    for tokens, weight in tree_assignments(parents, prefix, q, drafts):
        paths = [tuple(tokens[a] for a in _ancestors(parents, i) + [i]) for i in range(n)]
        p_all = torch.stack([p(prefix)] + [p(prefix + path) for path in paths])  # [n + 1, V]
        q_all = None if drafts != "q" else torch.stack([q(prefix + path[:-1]) for path in paths])  # [n, V]
        tree = DraftTree(torch.tensor(tokens), parents, q_all)
        accept_cuts: dict = defaultdict(set)
        draw_cuts: dict = defaultdict(set)
        for node in range(-1, n):  # every node that could be reached, the root (-1) included
            kids = shape.children[node + 1]
            level = levels[node] + 1 if node >= 0 else 0
            accept, draw = node_breakpoints(p_all[node + 1], [(tokens[c], None if q_all is None else q_all[c])
                                                               for c in kids])
            for i, cuts in accept.items():
                accept_cuts[level, i] |= cuts
            draw_cuts[level] |= draw
        stack = [({}, weight)]
        while stack:
            assigned, w = stack.pop()
            try:
                result = verify(tree, p_all, Probe(assigned))
            except NeedValue as need:
                kind, depth, *child = need.args[0]
                cuts = accept_cuts[depth, child[0]] if kind == "accept" else draw_cuts[depth]
                for u, width in cells(cuts):
                    stack.append(({**assigned, need.args[0]: u}, w * width))
                continue
            step[tuple(tokens[a] for a in result.accepted) + (result.next_token,)] += w
    T = max(levels) + 2
    return continue_with_target(step, p, prefix, T), target_joint(p, prefix, T)


PREFIXES = [(0,), (1,), (2,), (1, 1)]
TREES = {
    "root_branches": (-1, -1, 0),
    "branches_below_root": (-1, 0, 0, 1),
    "two_levels_of_branching": (-1, -1, 0, 0),
    "chain": (-1, 0, 1),
}


@pytest.mark.parametrize("drafts", ["q", "distinct", "repeated"])
@pytest.mark.parametrize("shape", list(TREES))
def test_verify_sampling_is_exactly_the_target(shape, drafts):
    for prefix in PREFIXES:  # a few random p and q for each shape
        got, want = tree_distribution(TREES[shape], drafts, f"{shape}-{drafts}", prefix=prefix)
        assert sum(got.values()) == pytest.approx(1.0, abs=TOLERANCE)
        assert max_error(got, want) < TOLERANCE, prefix


def test_exact_tree_check_rejects_a_wrong_verifier():
    """Negative control: drafts drawn from q verified as if they were one-hot (x accepted with p(x), not p(x)/q(x))."""
    def as_one_hot(tree, p_all, uniforms):
        return verify_sampling(DraftTree(tree.tokens, tree.parents, None), p_all, uniforms)

    got, want = tree_distribution(TREES["root_branches"], "q", "root_branches-q", verify=as_one_hot)
    assert max_error(got, want) > 1e-3


# -- the two verifiers agree, and draw from their own positions -----------------------------------------------------


def test_chain_and_tree_verifiers_take_the_same_decisions():
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        K = trial % 4
        length = int(torch.randint(0, K + 1, (), generator=gen))
        p = torch.softmax(torch.randn(K + 1, 5, generator=gen) * 2, -1).double()
        q = torch.softmax(torch.randn(K, 5, generator=gen) * 2, -1).double()
        tokens = torch.randint(0, 5, (K,), generator=gen)
        uniforms = StepUniforms(RequestRandom(trial), start=7)
        u_accept = torch.tensor([[uniforms.accept(d, 0) for d in range(K)]], dtype=torch.float64).view(1, K)
        u_draw = torch.tensor([[uniforms.draw(d) for d in range(K + 1)]], dtype=torch.float64)
        for draft_probs in (q, None):
            n, y = verify_chains(p[None], None if draft_probs is None else draft_probs[None], tokens[None],
                                 torch.tensor([length]), u_accept, u_draw)
            tree = DraftTree.chain(tokens[:length], None if draft_probs is None else draft_probs[:length])
            result = verify_sampling(tree, p[:length + 1], uniforms)
            assert (len(result.accepted), result.next_token) == (int(n), int(y))


def test_step_uniforms_are_keyed_by_output_position():
    random_ = RequestRandom(11)
    early, late = StepUniforms(random_, 3), StepUniforms(random_, 5)
    assert early.accept(2, 0) == late.accept(0, 0) == random_.uniform(5, ACCEPT, 0)
    assert early.draw(4) == late.draw(2) == random_.uniform(7, DRAW)
    assert early.accept(2, 1) != early.accept(2, 0) != early.draw(2)
    assert RequestRandom(11).uniform(5, ACCEPT) == random_.uniform(5, ACCEPT)
    assert RequestRandom(12).uniform(5, ACCEPT) != random_.uniform(5, ACCEPT)
