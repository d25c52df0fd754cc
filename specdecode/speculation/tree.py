"""Draft trees: the one shape every proposer produces.

A tree of n draft tokens is a parent array (parents[i] < i, -1 = child of the last committed token). A chain of K
tokens is parents [-1, 0, 1, ..., K-2]. Everything derived from a shape (attention mask, depths, children,
root-to-leaf paths) is computed once per distinct shape and cached.

A tree may carry a lookahead branch: tokens that ride along in the same target pass, under the same kind of tree
mask, without being verified (Lookahead decoding's Jacobi window); the step runner hands back the target's argmax
at each of them, and nothing of them is committed.
"""
from __future__ import annotations

import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """Everything derived from a parent array; built once per distinct shape by `tree_shape`."""

    parents: tuple[int, ...]
    depths: torch.Tensor
    """[n] depth of each node, 0 for children of the committed prefix."""
    attention_mask: torch.Tensor
    """[n, n] bool, mask[i, j] = node j is node i or one of its ancestors."""
    children: tuple[tuple[int, ...], ...]
    """children[i + 1] = child nodes of node i, in order; children[0] = the root's children (parent -1)."""
    paths: tuple[tuple[int, ...], ...]
    """Every root-to-leaf path as node indices."""
    is_chain: bool
    """Whether the tree is a single chain (parents -1, 0, 1, ...); the empty tree is a chain."""


@functools.lru_cache(maxsize=1024)
def tree_shape(parents: tuple[int, ...]) -> TreeShape:
    n = len(parents)
    depths = [0] * n
    children: list[list[int]] = [[] for _ in range(n + 1)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree node {i} has parent {p}; a parent must be -1 or an earlier node")
        depths[i] = 0 if p < 0 else depths[p] + 1
        children[p + 1].append(i)
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    leaves = [i for i in range(n) if not children[i + 1]]
    paths = []
    for leaf in leaves:
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(tuple(reversed(path)))
    return TreeShape(parents=tuple(parents), depths=torch.tensor(depths, dtype=torch.long), attention_mask=mask,
                     children=tuple(tuple(c) for c in children), paths=tuple(paths),
                     is_chain=tuple(parents) == chain_parents(n))


def chain_parents(k: int) -> tuple[int, ...]:
    return tuple(range(-1, k - 1))


def paths_to_parents(paths: list[tuple[int, ...]]) -> tuple[int, ...]:
    """A static tree given as Medusa's "choices" (node i = the path of child ranks from the root, parents listed
    before children) -> its parent array."""
    index = {tuple(path): i for i, path in enumerate(paths)}
    parents = []
    for i, path in enumerate(paths):
        parent = index.get(tuple(path[:-1]), -1) if len(path) > 1 else -1
        if len(path) > 1 and not 0 <= parent < i:
            raise ValueError(f"tree path {path} comes before its parent {path[:-1]} or has none")
        parents.append(parent)
    return tuple(parents)


def merge_paths(sequences) -> tuple[list[int], list[int], list[int]]:
    """Token sequences merged into a trie: (tokens, parents, counts), parents before children, children in
    first-seen order; counts[i] = how many sequences pass through node i."""
    tokens: list[int] = []
    parents: list[int] = []
    counts: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for seq in sequences:
        node = -1
        for token in seq:
            child = index.get((node, token))
            if child is None:
                child = index[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
                counts.append(0)
            counts[child] += 1
            node = child
    return tokens, parents, counts


@dataclasses.dataclass
class LookaheadBranch:
    """Unverified nodes of a step's target pass: the target reads them, its argmax at each comes back in
    `outputs`; they are never accepted nor committed."""

    tokens: torch.Tensor
    """[m] token ids."""
    parents: tuple[int, ...]
    """[m] parent of each node within the branch, -1 = child of the last committed token (as a draft tree's)."""
    outputs: list[int] | None = None
    """[m] the target's argmax at each node, set by the step runner after the pass."""

    def __post_init__(self):
        self.parents = tuple(self.parents)
        if len(self.parents) != len(self.tokens):
            raise ValueError(f"a lookahead branch has {len(self.tokens)} tokens but {len(self.parents)} parents")


@dataclasses.dataclass
class DraftTree:
    """The draft for one sequence."""

    tokens: torch.Tensor
    """[n] draft token ids."""
    parents: torch.Tensor | tuple[int, ...]
    """[n] index of each node's parent, -1 = child of the last committed token."""
    draft_probs: torch.Tensor | None = None
    """[n, vocab] the (processed) distribution each node's token was drawn from; None = deterministic guesses."""
    lookahead: LookaheadBranch | None = None
    """Unverified nodes that ride along in the target pass after the draft's (None = none)."""
    confidence: int = 0
    """The proposer's own coarse class of how sure its guess is (prompt lookup and suffix decoding: the length of
    the match it continues); a combining proposer (auto) learns acceptance per class. 0 = none given."""
    node_confidence: tuple[int, ...] | None = None
    """[n] a class per node instead (the draft model: how likely it found each token), or None: `confidence`."""

    def __post_init__(self):
        if isinstance(self.parents, torch.Tensor):
            self.parents = tuple(self.parents.tolist())
        self.parents = tuple(self.parents)
        if len(self.parents) != len(self.tokens):
            raise ValueError(f"a draft tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError(f"draft_probs has {self.draft_probs.shape[0]} rows for {len(self.tokens)} tokens")

    @classmethod
    def chain(cls, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        return cls(tokens=tokens, parents=chain_parents(len(tokens)), draft_probs=draft_probs)

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls(tokens=torch.zeros(0, dtype=torch.long), parents=())

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def pass_size(self) -> int:
        """Nodes the target reads for this tree: the draft's, then the lookahead branch's."""
        return len(self.parents) + (len(self.lookahead.parents) if self.lookahead is not None else 0)

    @property
    def pass_tokens(self) -> torch.Tensor:
        """[pass_size] the draft's tokens, then the branch's."""
        if self.lookahead is None:
            return self.tokens
        return torch.cat([self.tokens, self.lookahead.tokens])

    @property
    def pass_parents(self) -> tuple[int, ...]:
        """Parents of [draft nodes, branch nodes] as one parent array (the branch's indices shifted past the
        draft's): the pass's tree mask and positions come from it."""
        if self.lookahead is None:
            return self.parents
        n = len(self.parents)
        return self.parents + tuple(p + n if p >= 0 else -1 for p in self.lookahead.parents)

    @property
    def shape(self) -> TreeShape:
        return tree_shape(self.parents)

    @property
    def depths(self) -> torch.Tensor:
        return self.shape.depths

    @property
    def attention_mask(self) -> torch.Tensor:
        return self.shape.attention_mask

    @property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        return self.shape.paths

    def path_to(self, node: int) -> list[int]:
        path = [node]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]
