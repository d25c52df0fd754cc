"""EAGLE-2 proposer: a one-layer head reads the target's last-layer features and grows a dynamic draft tree.

The head's KV cache entry j holds (token x_{j+1}, target feature f_j) at rotary position j; its output predicts
the feature f_{j+1} and the token x_{j+2}. Each step the head first reads the entries the target committed since
the last step, with their real features (taken from the verifying pass: never a second target pass); the last
one's output proposes depth 1. Then, per depth, the top-k nodes by cumulative draft log-probability are expanded
(their entry: own token, parent's predicted feature) and each keeps its top-k children; finally the best nodes
of the whole tree by cumulative log-probability are reranked into the verified tree (EAGLE-2). Drafted entries
are never committed: the next step's catch-up overwrites them.

Nodes are chosen by top-k, not drawn from q, so trees are deterministic guesses (draft_probs None): the verifier's
one-hot multi-draft rule keeps sampling exact.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from specdecode.errors import ConfigError
from specdecode.speculation.methods import Method
from specdecode.sampling import params_tensors, processed_probs
from specdecode.speculation.heads import EagleHead, HeadConfig, rank_accuracy
from specdecode.speculation.proposers.base import FeatureRequest, TargetFeatures, race_perturbed
from specdecode.speculation.tree import DraftTree


@dataclasses.dataclass
class EagleConfig:
    """EAGLE-2 tree options (SGLang's names in the docstrings)."""

    model: str
    """Speculator directory (written by `specdecode train eagle`)."""
    max_depth: int = 5
    """Deepest tree level drafted (num_speculative_tokens, SGLang's speculative_num_steps)."""
    topk: int = 4
    """Nodes expanded per depth and children kept per expanded node (speculative_eagle_topk)."""
    nodes_per_level: int = 4
    """Tree nodes verified per drafted level: a tree of depth d has at most nodes_per_level * d nodes."""

    def __post_init__(self):
        for name in ("max_depth", "topk", "nodes_per_level"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"eagle: {name} must be a positive integer, got {getattr(self, name)!r}")

    def nodes(self, depth: int) -> int:
        """Verified nodes of a tree `depth` levels deep."""
        return self.nodes_per_level * depth


class EagleProposer:
    @property
    def draft_network(self):
        """What one draft level runs (see Proposer)."""
        return self.model

    def __init__(self, config: EagleConfig, head: EagleHead, rank_accuracy: list[list[float]] | None = None):
        """rank_accuracy[d][r]: the head's held-out P(its rank-r guess at depth d + 1 is right), from its card (None
        when the directory records none); the engine sizes the tree's width from it (engine/parts.fit_tree_width)."""
        self.config = config
        self.head = head
        self.rank_accuracy = rank_accuracy
        self.model = head.decoder  # what the cost model times as one draft forward (LLM.make_controller)
        self.feature_request = FeatureRequest(layers=head.feature_layers)
        self.cache = None
        # request -> the target's hidden states not yet in the head's cache: per pass, one [n, D] per feature layer
        self.unread: dict[str, list[tuple[torch.Tensor, ...]]] = {}
        self.added: set[str] = set()  # requests whose entries are in the head's cache
        self.start: dict[str, int] = {}  # request -> the head cache length its entries follow (its first unread)
        # slot -> the hidden states a finished request left unread, of the positions after the slot's head entries:
        # a later request reusing that prefix takes them (prefix caching reuses as much as the target holds,
        # also when the head never drafted and so holds no entries of its own)
        self.kept: dict[int, list[tuple[torch.Tensor, ...]]] = {}

    def set_nodes_per_level(self, nodes: int) -> None:
        """Verify at most `nodes` nodes per drafted level (the reranked tree of a d-level draft has nodes * d)."""
        self.config.nodes_per_level = nodes

    def ensure_cache(self, slots: int, max_len: int, pool_positions: int | None = None) -> None:
        """(The head's one-layer cache stays in the slots layout: it is a layer's worth per position.)"""
        need = max_len + self.config.topk * self.config.max_depth + 2
        if self.cache is None or self.cache.num_slots < slots or self.cache.max_len < need:
            old = self.cache
            self.cache = self.head.decoder.make_cache(max(slots, old.num_slots if old else 0),
                                                      max(need, old.max_len if old else 0))
            if old is not None:  # the entries (and `kept`, which follows them) stay reusable, as the target's rows do
                old.copy_into(self.cache)

    # -- sequences ------------------------------------------------------------------------------------------


    def cache_shortfall(self, seqs, budgets) -> int:
        return 0
    def observe_target(self, seqs, features: TargetFeatures) -> None:
        # Kept as the target gave them, per layer: a multi-layer head's reduce runs once over all the unread
        # positions when the head next reads them, not once a step (adaptive steps that do not draft read nothing).
        hidden = [features.layers[i] for i in self.head.feature_layers]  # each [B, A, D]
        for b, (seq, n) in enumerate(zip(seqs, features.counts)):
            if seq.request_id not in self.unread:  # its prefill's (first) pass
                self.unread[seq.request_id] = self._reused(seq)
            self.unread[seq.request_id].append(tuple(h[b, :n].clone() for h in hidden))

    def _reused(self, seq) -> list[tuple[torch.Tensor, ...]]:
        """A new request's features of the reused positions (Sequence.reused) that its slot's head entries do not
        cover, from what the slot's last request left (kept); records where its own entries start."""
        held = self._entries(seq.slot)
        self.start[seq.request_id] = start = min(seq.reused, held)
        kept = self.kept.pop(seq.slot, None)
        if seq.reused <= start:
            return []
        joined = [torch.cat([entry[j] for entry in kept]) for j in range(len(kept[0]))]  # from position `held`
        return [tuple(h[:seq.reused - start] for h in joined)]

    def _entries(self, slot: int) -> int:
        return int(self.cache.lengths[slot]) if self.cache is not None and 0 <= slot < self.cache.num_slots else 0

    def remove(self, seq) -> None:
        unread = self.unread.pop(seq.request_id, None)
        start = self.start.pop(seq.request_id, None)
        if self.cache is None or not 0 <= seq.slot < self.cache.num_slots:
            return
        if seq.request_id in self.added:
            self.added.discard(seq.request_id)  # its entries stay, followed by what it left unread
        else:  # the slot's entries are an older request's: valid for this one's tokens up to where its own began
            self.cache.lengths[seq.slot] = start or 0
        if unread:
            self.kept[seq.slot] = unread
        else:
            self.kept.pop(seq.slot, None)

    def observe(self, seqs, trees, results) -> None:
        """Nothing to keep: drafted entries carry predicted features; the accepted tokens are re-read next step
        with the target's real ones."""

    def _tails(self, seqs, keep_last: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Per sequence, the head entries the target committed that its cache lacks: tokens x_{j+1} and features
        f_j for j from the cache length to len(token_ids) - 2 (all but the last when keep_last)."""
        tokens, feats = [], []
        for seq, fed in zip(seqs, self.cache.lengths[[s.slot for s in seqs]].tolist()):
            pending = self.unread.get(seq.request_id) or [self.empty()]
            unread = [torch.cat([entry[j] for entry in pending]) for j in range(len(pending[0]))]  # per layer
            tail = seq.token_ids[fed + 1:]
            if len(tail) != len(unread[0]):
                raise RuntimeError(f"eagle: request {seq.request_id} has {len(tail)} new tokens but "
                                   f"{len(unread[0])} target features; observe_target missed a step")
            cut = len(tail) - 1 if keep_last else len(tail)
            tokens.append(tail[:cut])
            feats.append(self.head.target_features([h[:cut] for h in unread]).to(self.head.decoder.dtype))
            self.unread[seq.request_id] = [tuple(h[cut:] for h in unread)]
        return tokens, feats

    def empty(self) -> tuple[torch.Tensor, ...]:
        """No positions, per feature layer."""
        d = self.head.decoder.config.hidden_size
        return tuple(torch.zeros(0, d, dtype=self.head.decoder.dtype, device=self.head.decoder.device)
                     for _ in self.head.feature_layers)

    def _read(self, seqs, tokens: list[list[int]], feats: list[torch.Tensor]) -> torch.Tensor:
        """Run the head over each sequence's new entries and commit them; returns the outputs [B, T, D]."""
        device = self.head.decoder.device
        lens = [len(t) for t in tokens]
        T = max(lens)
        ids = torch.tensor([t + [0] * (T - len(t)) for t in tokens], device=device)  # [B, T]
        x = pad_sequence(feats, batch_first=True)  # [B, T, D]
        slots = torch.tensor([s.slot for s in seqs])
        out, _ = self.head(ids, x, cache=self.cache, slots=slots, compute_logits=False)
        self.cache.advance(slots, torch.tensor(lens))
        return out

    @torch.no_grad()
    def held_prefix(self, slot: int) -> int:
        """Entries j < n of the slot's head cache hold (x_{j+1}, f_j) of its last request, and `kept` the target's
        features of the positions after them that it left unread: a new request sharing its first tokens may reuse
        that many target positions (it takes the kept features of those it reuses)."""
        kept = self.kept.get(slot)
        return self._entries(slot) + (sum(len(entry[0]) for entry in kept) if kept else 0)

    def add(self, seqs) -> None:
        """The head's prefill: every committed entry but the last (whose output proposes the first tree), after the
        entries a reused prefix left in the slot (where its unread features start, see _reused)."""
        starts = torch.tensor([self.start[s.request_id] for s in seqs])
        self.cache.rollback(torch.tensor([s.slot for s in seqs]), starts)
        self.added.update(s.request_id for s in seqs)
        tokens, feats = self._tails(seqs, keep_last=True)
        rows = [b for b, t in enumerate(tokens) if t]
        if rows:
            self._read([seqs[b] for b in rows], [tokens[b] for b in rows], [feats[b] for b in rows])

    # -- drafting -------------------------------------------------------------------------------------------

    def _log_q(self, logits: torch.Tensor, seqs, per_row: int) -> torch.Tensor:
        """Draft log-probabilities [N, Vd] from logits [N, Vd] (N = rows * per_row): the request's processed
        distribution (temperature, top-k, top-p) for sampled requests, the plain softmax for greedy ones."""
        if all(s.params.greedy for s in seqs):
            return torch.log_softmax(logits.float(), dim=-1)
        params = [dataclasses.replace(s.params, temperature=1.0, top_k=0, top_p=1.0) if s.params.greedy
                  else s.params for s in seqs]
        q = processed_probs(logits, *params_tensors(params, [per_row] * len(seqs), device=logits.device))
        return q.log()

    @torch.no_grad()
    def propose(self, seqs, budgets: list[int]) -> list[DraftTree]:
        trees = [DraftTree.empty() for _ in seqs]
        rows = [i for i, b in enumerate(budgets) if b > 0]
        if rows:
            caps = [min(budgets[i], self.config.max_depth) for i in rows]
            for i, tree in zip(rows, self._draft([seqs[i] for i in rows], caps)):
                trees[i] = tree
        return trees

    def _draft(self, seqs, caps: list[int]) -> list[DraftTree]:
        head, cfg = self.head, self.config
        device = head.decoder.device
        B, D = len(seqs), max(caps)
        slots = torch.tensor([s.slot for s in seqs])
        tokens, feats = self._tails(seqs, keep_last=False)
        out = self._read(seqs, tokens, feats)  # [B, T, D]
        last = torch.tensor([len(t) - 1 for t in tokens], device=device)
        g_root = out[torch.arange(B, device=device), last]  # [B, D]: the predicted feature after the pending token
        logits = head.decoder.lm_head(head.decoder.model.norm(g_root))  # [B, Vd]
        k = min(cfg.topk, logits.shape[-1])
        log_q = race_perturbed(self._log_q(logits, seqs, 1), seqs, 0, 1, head.draft_to_target)
        scores, cand = log_q.topk(k, dim=-1)  # [B, k] depth-1 nodes
        pool = _Pool(scores, cand, torch.full((B, k), -1, device=device), 0)
        # The k nodes of the current depth that are expanded: pool indices, scores, draft ids, parent features.
        exp_pool = torch.arange(k, device=device).expand(B, k)
        exp_scores, exp_tokens = scores, cand
        exp_feats = g_root[:, None].expand(B, k, g_root.shape[-1])
        fed_mask = torch.zeros(B, 0, 0, dtype=torch.bool, device=device)  # [B, F, F]: ancestors among fed entries
        exp_parent_fed = None  # [B, k] fed index of each expanded node's parent (None at depth 1)
        position = self.cache.lengths[slots].to(device)  # [B]: where depth-1 entries sit
        eye = torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)
        for depth in range(1, D):
            fed = fed_mask.shape[1]
            if exp_parent_fed is None:
                seen = eye
            else:  # a node sees what its parent sees (the parent included) and itself
                seen = torch.cat([fed_mask.gather(1, exp_parent_fed[..., None].expand(B, k, fed)), eye], dim=2)
            fed_mask = torch.cat([torch.cat([fed_mask, fed_mask.new_zeros(B, fed, k)], dim=2), seen], dim=1)
            g, logits = head(head.draft_to_target[exp_tokens], exp_feats, cache=self.cache, slots=slots,
                             positions=(position + depth - 1)[:, None].expand(B, k), tree_mask=seen, pending=fed)
            log_q = race_perturbed(self._log_q(logits.reshape(B * k, -1), seqs, k), seqs, depth, k,
                                   head.draft_to_target).view(B, k, -1)  # [B, k, Vd]
            child_scores, child_tokens = (exp_scores[..., None] + log_q).topk(k, dim=-1)  # [B, k, k]
            child_scores, child_tokens = child_scores.reshape(B, k * k), child_tokens.reshape(B, k * k)
            first = pool.size
            pool.append(child_scores, child_tokens, exp_pool.repeat_interleave(k, dim=1), depth)
            exp_scores, best = child_scores.topk(k, dim=-1)  # [B, k]: the next depth's expanded nodes
            exp_tokens = child_tokens.gather(1, best)
            exp_pool = first + best
            parent = best // k  # which of this depth's expanded nodes is the parent
            exp_feats = g.gather(1, parent[..., None].expand(B, k, g.shape[-1]))
            exp_parent_fed = fed + parent
        return pool.rerank(torch.tensor(caps, device=device), [cfg.nodes(c) for c in caps], head.draft_to_target)


class _Pool:
    """Every candidate node of one drafting step, per row: cumulative log-probability, draft id, parent (pool
    index, -1 = root) and depth (0 = child of the pending token). Candidates are appended depth by depth, so a
    parent always has a smaller index than its children."""

    def __init__(self, scores, tokens, parents, depth: int):
        self.scores, self.tokens, self.parents = [scores], [tokens], [parents]
        self.depths = [torch.full_like(parents, depth)]
        self.size = scores.shape[1]

    def append(self, scores, tokens, parents, depth: int) -> None:
        self.scores.append(scores)
        self.tokens.append(tokens)
        self.parents.append(parents)
        self.depths.append(torch.full_like(parents, depth))
        self.size += scores.shape[1]

    def rerank(self, caps: torch.Tensor, nodes: list[int], draft_to_target: torch.Tensor) -> list[DraftTree]:
        """Per row, the `nodes[b]` best candidates shallower than caps[b] (by cumulative log-probability; ties go
        to the shallower, earlier node, so a chosen node's parent is always chosen too), as a DraftTree in target
        ids. Candidates the draft gives probability 0 are dropped."""
        scores = torch.cat(self.scores, 1)  # [B, P]
        tokens, parents, depths = (torch.cat(x, 1) for x in (self.tokens, self.parents, self.depths))
        B, P = scores.shape
        device = scores.device
        key = scores.masked_fill(depths >= caps[:, None], float("-inf"))
        M = min(max(nodes), P)
        order = key.sort(dim=1, descending=True, stable=True).indices[:, :M]  # [B, M]
        rank = torch.arange(M, device=device)
        valid = (key.gather(1, order) > float("-inf")) & (rank[None, :] < torch.tensor(nodes, device=device)[:, None])
        chosen = torch.where(valid, order, P).sort(dim=1).values  # [B, M] pool indices, ascending; P = unused
        new_index = torch.full((B, P + 1), -1, dtype=torch.long, device=device)
        new_index.scatter_(1, chosen, rank.expand(B, M).contiguous())
        picked = chosen.clamp(max=P - 1)
        parent_pool = parents.gather(1, picked)
        new_parents = torch.where(parent_pool < 0, -1, new_index.gather(1, parent_pool.clamp(min=0)))
        target_ids = draft_to_target[tokens.gather(1, picked)]
        counts, target_ids, new_parents = valid.sum(1).tolist(), target_ids.cpu(), new_parents.cpu()  # one sync
        return [DraftTree(target_ids[b, :n], tuple(new_parents[b, :n].tolist())) for b, n in enumerate(counts)]


def _build(config, context) -> EagleProposer:
    from specdecode.speculation.config import load_head

    head = load_head(config, context.target, "eagle")
    eagle = EagleConfig(str(config.model), config.num_speculative_tokens, config.eagle_topk, config.nodes_per_level)
    card = HeadConfig.read(Path(config.model))
    accuracy = rank_accuracy(card.topk_accuracy, card.topk_ranks) if card.topk_accuracy else None
    return EagleProposer(eagle, head, accuracy)


METHOD = Method("eagle", _build, model="speculator", model_required=True, options=("eagle_topk", "num_tree_nodes"),
                nodes_per_level=lambda config: math.ceil(config.tree_nodes / config.num_speculative_tokens),
                draft_memory="heads", cache_margin=lambda config: config.eagle_topk * config.max_depth + 2,
                trainer="eagle")
