"""Draft trees against brute-force constructions."""
import random

import pytest
import torch

from specdecode.engine.batch import verify_layout
from specdecode.speculation.tree import DraftTree, chain_parents, tree_shape


def random_parents(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(-1, i) for i in range(n))


def ancestors_or_self(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_shape_matches_brute_force(seed):
    rng = random.Random(seed)
    parents = random_parents(rng, rng.randint(1, 12))
    shape = tree_shape(parents)
    n = len(parents)
    for i in range(n):
        anc = ancestors_or_self(parents, i)
        assert shape.attention_mask[i].tolist() == [j in anc for j in range(n)]
        assert int(shape.depths[i]) == len(anc) - 1
    leaves = {i for i in range(n) if i not in parents}
    assert {p[-1] for p in shape.paths} == leaves
    for path in shape.paths:
        assert parents[path[0]] == -1
        assert all(parents[b] == a for a, b in zip(path, path[1:]))
    for i in range(-1, n):
        assert list(shape.children[i + 1]) == [j for j in range(n) if parents[j] == i]


def test_chain_is_a_single_path_and_shapes_are_cached():
    parents = chain_parents(5)
    assert parents == (-1, 0, 1, 2, 3)
    shape = tree_shape(parents)
    assert shape.paths == ((0, 1, 2, 3, 4),)
    assert torch.equal(shape.attention_mask, torch.ones(5, 5, dtype=torch.bool).tril())
    assert tree_shape(parents) is shape


def test_bad_parent_is_rejected():
    with pytest.raises(ValueError, match="parent"):
        tree_shape((-1, 1))
    with pytest.raises(ValueError, match="parents"):
        DraftTree(tokens=torch.tensor([1, 2]), parents=(-1,))


@pytest.mark.parametrize("seed", range(5))
def test_verify_layout_prepends_root_and_pads(seed):
    rng = random.Random(seed)
    parents = random_parents(rng, 6)
    mask, offsets = verify_layout(parents, 9)
    assert mask[0].tolist() == [True] + [False] * 8  # the root sees only itself (and the prefix)
    for i in range(6):
        anc = ancestors_or_self(parents, i)
        assert mask[i + 1].tolist() == [True] + [j in anc for j in range(6)] + [False] * 2
        assert int(offsets[i + 1]) == len(anc)
    for pad in (7, 8):
        assert mask[pad].tolist() == [j in (0, pad) for j in range(9)]
