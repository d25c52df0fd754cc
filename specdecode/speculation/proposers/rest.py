"""REST (He et al., 2024): drafts retrieved from a datastore of text. Each step finds the longest suffix of the
sequence (16 tokens down to 2) that occurs in the datastore, takes up to 64 of the continuations that followed it,
merges them into a trie whose nodes count the continuations through them, keeps the most frequent nodes (as many
as the step's budget) and has them verified as a tree. Drafts are deterministic guesses (one-hot): greedy output
equals plain decoding and sampling stays lossless.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from specdecode.errors import ConfigError
from specdecode.speculation.methods import FORCED_RUN, Method
from specdecode.speculation.datastore import Datastore
from specdecode.speculation.proposers.base import NO_FEATURES, WithoutDraftCache
from specdecode.speculation.tree import DraftTree, merge_paths


@dataclasses.dataclass
class RestConfig:
    """REST options."""

    max_depth: int = 5
    """Deepest tree level (num_speculative_tokens)."""
    num_nodes: int = 20
    """Tree nodes at full depth; a shallower tree gets a proportional share."""
    longest_suffix: int = 16
    """Longest context suffix looked up."""
    shortest_suffix: int = 2
    """Shortest context suffix looked up (none shorter: no draft)."""
    max_continuations: int = 64
    """Occurrences of the matched suffix whose continuations make the trie."""

    def __post_init__(self):
        for name in ("max_depth", "num_nodes", "shortest_suffix", "max_continuations"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"rest: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.longest_suffix < self.shortest_suffix:
            raise ConfigError(f"rest: need shortest_suffix <= longest_suffix, got {self.shortest_suffix} and "
                              f"{self.longest_suffix}")


def frequency_tree(continuations: list[tuple[int, ...]], num_nodes: int) -> tuple[list[int], list[int]]:
    """The continuations merged into a trie, cut to its num_nodes most frequent nodes (ties: the shallower, then
    the first seen). A node is never more frequent than its parent, so the kept nodes form a tree; they come
    parents first, each node's children from the most frequent."""
    tokens, parents, counts = merge_paths(continuations)
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    kept = sorted(range(len(tokens)), key=lambda i: (-counts[i], depths[i], i))[:num_nodes]
    position = {node: i for i, node in enumerate(kept)}
    return [tokens[i] for i in kept], [position[parents[i]] if parents[i] >= 0 else -1 for i in kept]


class RestProposer(WithoutDraftCache):
    trees_rewritable = True
    feature_request = NO_FEATURES

    def __init__(self, config: RestConfig, store: Datastore):
        self.config = config
        self.store = store

    def add(self, seqs) -> None:
        """Nothing per sequence: the datastore is shared and read-only."""

    def remove(self, seq) -> None:
        pass

    def observe(self, seqs, trees, results) -> None:
        pass

    def propose(self, seqs, budgets: list[int]) -> list[DraftTree]:
        config = self.config
        trees = []
        for seq, budget in zip(seqs, budgets):
            depth = min(budget, config.max_depth)
            if depth <= 0:
                trees.append(DraftTree.empty())
                continue
            continuations = self.store.continuations(seq.token_ids, depth, config.max_continuations,
                                                     config.longest_suffix, config.shortest_suffix)
            tokens, parents = frequency_tree(continuations, math.ceil(config.num_nodes * depth / config.max_depth))
            trees.append(DraftTree(torch.tensor(tokens, dtype=torch.long), tuple(parents)))
        return trees


def _build(config, context) -> RestProposer:
    from specdecode.speculation.datastore import open_datastore

    store = open_datastore(config.model, context.tokenizer, context.target_dir)
    return RestProposer(RestConfig(config.num_speculative_tokens, config.tree_nodes), store)


METHOD = Method("rest", _build, model="datastore", options=("num_tree_nodes",),
                nodes_per_level=lambda config: math.ceil(config.tree_nodes / config.num_speculative_tokens),
                forced_run=FORCED_RUN)
