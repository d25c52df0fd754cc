"""Medusa-1 proposer: K heads on the target's last normed hidden state guess the tokens 2..K+1 positions ahead.

The hidden state at the last committed position predicted the pending token (through the target's own head);
Medusa head i reads it and guesses the token i + 1 places after the pending one, so the tree hangs below the
pending token: depth d holds head d's candidates. The tree's shape is static, built once by the Medusa paper's
greedy construction from the heads' measured top-k accuracies: keep adding the node whose path (a rank per
depth) has the highest estimated probability of being right, the product of its ranks' accuracies.

The heads' top-k tokens are deterministic guesses (draft_probs None): verification is the lossless one-hot rule,
not Medusa's typical acceptance.
"""
from __future__ import annotations

import dataclasses
import heapq
import json
import math
from pathlib import Path

import torch

from specdecode.errors import ConfigError
from specdecode.sampling import MIN_TEMPERATURE
from specdecode.speculation.methods import Method
from specdecode.speculation.heads import MedusaHeads, rank_accuracy
from specdecode.speculation.proposers.base import FeatureRequest, TargetFeatures, WithoutDraftCache, race_perturbed
from specdecode.speculation.tree import DraftTree, paths_to_parents


def default_rank_accuracy(num_heads: int, ranks: int = 10) -> list[list[float]]:
    """A guess for heads without measured accuracies: P(rank r of head i is right) = 0.6 * 0.75^i * 0.35^r."""
    return [[0.6 * 0.75 ** i * 0.35 ** r for r in range(ranks)] for i in range(num_heads)]


def greedy_tree(accuracy: list[list[float]], num_nodes: int) -> list[tuple[int, ...]]:
    """The Medusa paper's construction: paths (a rank per depth, depth i using head i) added best-first by the
    product of their ranks' accuracies, num_nodes of them. A child never beats its parent, so the result is a
    tree (every path's prefixes are in it), listed parents first."""
    heap = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0]))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_nodes:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < len(accuracy):
            for r, a in enumerate(accuracy[len(path)]):
                heapq.heappush(heap, (neg * a, path + (r,)))
    order = {path: i for i, path in enumerate(chosen)}
    return sorted(chosen, key=lambda p: (len(p), order[p]))


@dataclasses.dataclass
class MedusaConfig:
    """Medusa options."""

    model: str
    """Speculator directory (written by `specdecode train medusa`)."""
    max_depth: int = 5
    """Deepest tree level (num_speculative_tokens); at most the number of heads."""
    num_nodes: int = 16
    """Nodes of the static tree at full depth."""

    def __post_init__(self):
        for name in ("max_depth", "num_nodes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"medusa: {name} must be a positive integer, got {getattr(self, name)!r}")


def read_accuracy(folder: Path, num_heads: int) -> list[list[float]]:
    """The heads' per-rank accuracies from config.json's `topk_accuracy` (with `topk_ranks`, or the ranks in
    training.json), or a default guess when the directory does not record them."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    measured = raw.get("topk_accuracy")
    if not measured:
        return default_rank_accuracy(num_heads)
    ranks = raw.get("topk_ranks")
    training = Path(folder) / "training.json"
    if ranks is None and training.is_file():
        ranks = json.loads(training.read_text()).get("heldout_topk_accuracy", {}).get("ranks")
    if len(measured) != num_heads:
        raise ConfigError(f"{folder}/config.json: topk_accuracy has {len(measured)} rows for {num_heads} heads")
    return rank_accuracy(measured, ranks)


class MedusaProposer(WithoutDraftCache):
    feature_request = FeatureRequest(final=True)

    def held_prefix(self, slot: int) -> None:
        """The heads read only the last hidden state: any reused prefix will do."""
        return None

    def __init__(self, config: MedusaConfig, heads: MedusaHeads, accuracy: list[list[float]]):
        self.config = config
        self.heads = heads
        depth = min(config.max_depth, len(heads.blocks))
        vocab = len(heads.draft_to_target)
        self.rank_accuracy = [row[:vocab] for row in accuracy[:depth]]
        """Per head, P(its rank-r guess is right) (what the tree is built from; the engine sizes its width by it)."""
        self.last_hidden: dict[str, torch.Tensor] = {}  # request -> normed hidden state [D] at its last position
        self.set_nodes_per_level(math.ceil(config.num_nodes / config.max_depth), config.num_nodes)

    def set_nodes_per_level(self, nodes: int, total: int | None = None) -> None:
        """Build the static trees: `total` nodes at full depth (default nodes x the deepest level), and for a
        shallower step of d levels the best tree of nodes x d nodes within them (what the speculation controller
        prices a d-level step at)."""
        self.nodes_per_level = nodes
        self.config.num_nodes = total or nodes * self.config.max_depth
        self.trees = {cap: self.paths_for(cap) for cap in range(1, self.config.max_depth + 1)}
        self.paths = self.trees[self.config.max_depth]
        self.ranks = 1 + max(max(path) for paths in self.trees.values() for path in paths)  # top-k needed per head
        self.subtrees: dict[int, tuple] = {}

    def paths_for(self, cap: int) -> list[tuple[int, ...]]:
        """The static tree of a step drafting `cap` levels: its paths (a rank per depth), parents first."""
        return greedy_tree(self.rank_accuracy[:cap], min(self.config.num_nodes, self.nodes_per_level * cap))

    def observe_target(self, seqs, features: TargetFeatures) -> None:
        for b, (seq, n) in enumerate(zip(seqs, features.counts)):
            self.last_hidden[seq.request_id] = features.final[b, n - 1].clone()

    def add(self, seqs) -> None:
        """Nothing to prefill: the heads read one hidden state."""

    def remove(self, seq) -> None:
        self.last_hidden.pop(seq.request_id, None)

    def observe(self, seqs, trees, results) -> None:
        """Nothing to learn: the next hidden state comes through observe_target."""

    def subtree(self, cap: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """The static tree of a `cap`-level step: head index [n], rank [n] and parents."""
        if cap not in self.subtrees:
            paths = self.trees[min(cap, self.config.max_depth)]
            self.subtrees[cap] = (torch.tensor([len(p) - 1 for p in paths], dtype=torch.long),
                                  torch.tensor([p[-1] for p in paths], dtype=torch.long), paths_to_parents(paths))
        return self.subtrees[cap]

    @torch.no_grad()
    def propose(self, seqs, budgets: list[int]) -> list[DraftTree]:
        trees = [DraftTree.empty() for _ in seqs]
        rows = [i for i, b in enumerate(budgets) if b > 0]
        if not rows:
            return trees
        hidden = torch.stack([self.last_hidden[seqs[i].request_id] for i in rows])  # [R, D]
        logits = self.heads(hidden)  # [H, R, Vd]
        drafting = [seqs[i] for i in rows]
        if any(s.race_at(0) is not None for s in drafting):  # raced requests rank by log q + the race's noise
            temperature = torch.tensor([max(s.params.temperature, MIN_TEMPERATURE) for s in drafting],
                                       device=logits.device)[:, None]
            logits = torch.stack([race_perturbed((logits[h].float() / temperature).log_softmax(-1), drafting, h, 1,
                                                 self.heads.draft_to_target) for h in range(len(logits))])
        top = self.heads.draft_to_target[logits.topk(self.ranks, dim=-1).indices].cpu()  # [H, R, ranks]
        for row, i in enumerate(rows):
            heads, ranks, parents = self.subtree(budgets[i])
            trees[i] = DraftTree(top[heads, row, ranks], parents)
        return trees


def _build(config, context) -> MedusaProposer:
    from specdecode.speculation.config import load_head

    heads = load_head(config, context.target, "medusa")
    medusa = MedusaConfig(str(config.model), config.num_speculative_tokens, config.tree_nodes)
    return MedusaProposer(medusa, heads, read_accuracy(Path(config.model), len(heads.blocks)))


METHOD = Method("medusa", _build, model="speculator", model_required=True, options=("num_tree_nodes",),
                nodes_per_level=lambda config: math.ceil(config.tree_nodes / config.num_speculative_tokens),
                draft_memory="heads", cache_margin=lambda config: config.eagle_topk * config.max_depth + 2,
                trainer="medusa")
