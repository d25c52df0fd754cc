"""Draft-model proposer: a small model of the same vocabulary drafts `num_drafts` chains of K tokens per sequence
(one chain = classic speculative decoding; several = a tree whose root branches: the draft's top tokens for
greedy requests, independent samples for sampled ones). The draft keeps its own KV cache: each step it first
catches up on the tokens the target committed since its last step, then extends its chains one level per forward.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import operator

import torch

from specdecode.errors import ConfigError
from specdecode.speculation.methods import Method
from specdecode.model.cache import BLOCK_SIZE, common_prefix
from specdecode.model.llama import LlamaForCausalLM
from specdecode.sampling import params_tensors, processed_probs, race_tokens, sample_rows
from specdecode.speculation.proposers.base import NO_FEATURES
from specdecode.speculation.tree import DraftTree


@dataclasses.dataclass
class DraftModelConfig:
    """Draft-model options (vLLM's names where they exist)."""

    model: str
    """Directory of the draft checkpoint (same tokenizer as the target)."""
    num_speculative_tokens: int = 5
    """Depth K of every draft chain."""
    num_drafts: int = 1
    """Chains per sequence: 1 = a chain, more = a tree branching at the root."""
    draft_vocab: list[int] | None = None
    """Draft only these token ids (the draft's output head keeps their rows: see draft_head); None = every token."""

    def __post_init__(self):
        if self.num_speculative_tokens < 1:
            raise ConfigError("num_speculative_tokens must be >= 1 for the draft_model method")
        if self.num_drafts < 1:
            raise ConfigError("num_drafts must be >= 1")


@dataclasses.dataclass
class _Pending:
    """What observe() needs to know about the last proposal of one sequence."""

    tail_len: int
    padded_tail: int
    chains: list[list[int]]  # the tokens of each chain, every level drafted (also past the sequence's budget)
    fed_depth: int  # levels whose tokens went through the draft model (their keys and values are in the cache)
    prefix: list[int] = dataclasses.field(default_factory=list)  # guessed tokens fed after the tail (see propose)


CONFIDENCE_EDGES = (0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.95, 0.99)
"""A node's confidence class (DraftTree.node_confidence, what `auto` learns acceptance by) is how many of these its
draft probability reaches: 0 below 0.2, ..., 8 at 0.99 or more."""


class DraftModelProposer:
    feature_request = NO_FEATURES
    observes_tokens = True
    """observe() keeps what was committed, matched by token, not by the nodes of the tree it proposed: a combining
    proposer (auto) may have the target verify another tree in its place."""

    @property
    def draft_network(self):
        """What one draft level runs (see Proposer)."""
        return self.model

    def __init__(self, config: DraftModelConfig, model: LlamaForCausalLM):
        self.config = config
        self.model = model
        self.vocab_size = model.config.vocab_size  # what the verifier's q rows span
        if config.draft_vocab is not None:
            model.lm_head = draft_head(model.lm_head, config.draft_vocab)
        self.cache = None
        self.draft_len: dict[str, int] = {}  # request -> tokens committed in the draft cache
        self.held: dict[int, list[int]] = {}  # slot -> the tokens its rows hold from the request that left it
        self.kept_tokens = 0  # prompt tokens whose draft keys and values a slot held (not prefilled again)
        self.pending: dict[str, _Pending] = {}
        self.scores_nodes = False
        """When set (by `auto`): every node carries a confidence class from the draft's probability of it
        (DraftTree.node_confidence), and `deeper` may end a step's drafting early."""
        self.window: int | None = None
        """When set (by `auto`): a request joins with only its last `window` tokens prefilled (see add)."""
        self.windowed: set[str] = set()
        self.deeper = None
        """When set (by `auto`, from the measured costs): deeper(batch, levels, expected, gain) says whether one more
        level pays, given the tokens the drafted levels are expected to give (counting each row's committed one)
        and what the next level is expected to add; the draft's own probabilities estimate both."""

    @property
    def extra_positions(self) -> int:
        """Positions a row's step writes beyond its tokens (the drafted levels, and a margin)."""
        return 2 + self.config.num_drafts * self.config.num_speculative_tokens

    def ensure_cache(self, slots: int, max_len: int, pool_positions: int | None = None) -> None:
        """Paged beside a paged target: a pool of as many positions as the target's plus every row's drafts, and
        full blocks indexed by content as the target's are (prefixes shared across requests)."""
        need = max_len + self.extra_positions
        cache = self.cache
        if pool_positions is not None:
            blocks = -(-pool_positions // BLOCK_SIZE) + slots * -(-self.extra_positions // BLOCK_SIZE)
            if cache is None or not cache.paged:
                self.cache = self.model.make_cache(slots, need, block_size=BLOCK_SIZE, num_blocks=blocks)
                self.held.clear()
            else:
                cache.resize(slots, need)
                cache.grow_pool(blocks)
        elif cache is None or cache.paged or cache.num_slots < slots or cache.max_len < need:
            self.cache = self.model.make_cache(slots, need)
            self.held.clear()

    def cache_shortfall(self, seqs, budgets) -> int:
        """Blocks missing for a step: a row's tail and drafted levels, or all of a joining row's tokens (its window)."""
        cache = self.cache
        if cache is None or not cache.paged:
            return 0
        bs, need, most = cache.block_size, 0, 0
        rows = []  # (slot, end) of the joined rows, counted exactly only when the bound says the pool may be short
        for seq, budget in zip(seqs, budgets):
            if not budget:
                continue
            fed = self.draft_len.get(seq.request_id)
            if fed is None:
                held = len(seq.token_ids) if self.window is None else min(len(seq.token_ids), self.window + 1)
                need += -(-(held + self.extra_positions) // bs)
            else:
                written = len(seq.token_ids) - fed + self.extra_positions  # its tail and drafted levels
                most += written // bs + 2  # the blocks `written` positions can touch
                rows.append((seq.slot, written))
        if need + most <= cache.pool.available:
            return 0
        if rows:
            slots = [slot for slot, _ in rows]
            ends = (cache.lengths[slots] + torch.tensor([written for _, written in rows])).tolist()
            need += cache.blocks_needed_many(slots, ends)
        return max(0, need - cache.pool.available)

    @torch.no_grad()
    def add(self, seqs) -> None:
        """Prefill the draft's cache with every token but the pending one, as in the target's cache, after the
        beginning its slot still holds from the request that used it last (prefix caching); with a `window`, only
        the last `window` of them (the draft then sees a shorter context, at its own positions)."""
        fresh, kept = [], {}
        paged = self.cache.paged
        # how many of the rows begin with each first block (a row whose first block others share goes first)
        later_heads = collections.Counter(tuple(seq.token_ids[:self.cache.block_size]) for seq in seqs
                                          if len(seq.token_ids) > self.cache.block_size) if paged else {}
        for seq in seqs:
            n = len(seq.token_ids) - 1
            if paged:  # (a paged row holds nothing between requests: its blocks went back to the pool)
                self.cache.release(seq.slot)
                head = tuple(seq.token_ids[:self.cache.block_size])
                if head in later_heads:
                    later_heads[head] -= 1
            if self.window is not None and n > self.window:
                self._prefill([seq], [0], start=n - self.window)
                self.windowed.add(seq.request_id)
                continue
            if paged:  # the full blocks of its beginning that the draft cache holds, from any request
                keep = self.cache.adopt(seq.slot, self.cache.match(seq.token_ids, n))
            else:
                keep = min(common_prefix(self.held.pop(seq.slot, ()), seq.token_ids), n)
            if not keep and paged and later_heads.get(head, 0) > 0:
                self._prefill([seq], [0])  # alone first: the later ones that begin as it does share its blocks
            elif keep:
                kept.setdefault(keep, []).append(seq)
                self.kept_tokens += keep
            else:
                fresh.append(seq)
        for keep, group in kept.items():  # rows that keep as much run together (padding past a row is never kept)
            self._prefill(group, [keep] * len(group))
        if fresh:
            self._prefill(fresh, [0] * len(fresh))

    def _prefill(self, seqs, keep: list[int], start: int = 0) -> None:
        """The tokens from start + keep[i] on (all but the pending one) into rows that hold keep[i] already."""
        slots = torch.tensor([s.slot for s in seqs])
        self.cache.rollback(slots, torch.tensor(keep))
        lens = [len(s.token_ids) - 1 - start - k for s, k in zip(seqs, keep)]
        width = max(lens)
        if width:
            ids = torch.tensor([s.token_ids[start + k:start + k + n] + [0] * (width - n)
                                for s, k, n in zip(seqs, keep, lens)], device=self.model.device)  # [B, width]
            self.model(ids, cache=self.cache, slots=slots, compute_logits=False)  # padding is never committed
            self.cache.advance(slots, torch.tensor(lens))
        for seq, k, n in zip(seqs, keep, lens):
            self.draft_len[seq.request_id] = start + k + n
            if start == 0:  # (a window's rows hold other positions: not indexed)
                self.cache.index(seq.slot, seq.token_ids)

    def remove(self, seq) -> None:
        n = self.draft_len.pop(seq.request_id, None)
        self.pending.pop(seq.request_id, None)
        windowed = seq.request_id in self.windowed  # its rows hold a window, not the tokens from the first on
        self.windowed.discard(seq.request_id)
        if self.cache is not None and self.cache.paged and seq.slot >= 0:
            if n and not windowed:  # its full blocks stay indexed for a later request
                self.cache.index(seq.slot, seq.token_ids[:n])
            self.cache.release(seq.slot)
        elif n and not windowed and seq.slot >= 0:  # what its slot of the draft cache holds, for a later request
            self.held[seq.slot] = seq.token_ids[:n]

    def _pick(self, logits: torch.Tensor, seqs, greedy: bool, width: int,
              depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draw `width` tokens per row from logits [B, V] (or one per chain from [B, width, V]) at tree `depth`.
        Returns tokens [B, width] and, for sampled batches, the processed q they came from [B, width, V]."""
        B, V = logits.shape[0], logits.shape[-1]
        if greedy:
            if logits.dim() == 2:
                return logits.topk(width, dim=-1).indices, None
            return logits.argmax(-1), None
        per_chain = logits.dim() == 3
        rows = logits.reshape(-1, V)
        temperature, top_k, top_p, min_p = params_tensors([s.params for s in seqs], [width if per_chain else 1] * B,
                                                   device=logits.device)
        q = processed_probs(rows, temperature, top_k, top_p, min_p).view(B, -1, V)  # [B, 1 or width, V]
        q = q.expand(B, width, V)  # at the root, every chain draws independently from the same q
        u = torch.tensor([s.draft_uniforms(depth, width) for s in seqs], dtype=torch.float64,
                         device=logits.device)  # [B, w]
        tokens = sample_rows(q.reshape(-1, V), u.view(-1)).view(B, width)
        races = [s.race_at(depth) for s in seqs]
        raced = [b for b, race in enumerate(races) if race is not None]
        if raced:  # a raced request's chains guess the winner of the race under their own q (at the root, chain 0)
            chains = range(width) if per_chain else range(1)
            rows = [(b, c) for b in raced for c in chains]
            winners = race_tokens(q[[b for b, _ in rows], [c for _, c in rows]].contiguous(),
                                  [races[b][0] for b, _ in rows], [races[b][1] for b, _ in rows])
            tokens[[b for b, _ in rows], [c for _, c in rows]] = winners.to(tokens.device)
        return tokens, q

    @torch.no_grad()
    def propose(self, seqs, budgets: list[int], prefixes: list[list[int]] | None = None) -> list[DraftTree]:
        """prefixes (from `auto`): per row, tokens another source guessed, fed to the draft after the committed ones
        so that it drafts `budgets` levels below them; the row's tree is that path, then the draft's chains."""
        trees = [DraftTree.empty() for _ in seqs]
        rows = [i for i, b in enumerate(budgets) if b > 0]
        if not rows:
            return trees
        prefixes = prefixes or [[] for _ in seqs]
        # Greedy and sampled requests are drafted in separate batches (greedy needs no probabilities).
        for greedy in (True, False):
            group = [i for i in rows if seqs[i].params.greedy == greedy]
            if group:
                for i, tree in zip(group, self._draft([seqs[i] for i in group], [budgets[i] for i in group], greedy,
                                                      [list(prefixes[i]) for i in group])):
                    trees[i] = tree
        return trees

    def _draft(self, seqs, budgets: list[int], greedy: bool, prefixes: list[list[int]]) -> list[DraftTree]:
        device = self.model.device
        width = self.config.num_drafts
        K = min(max(budgets), self.config.num_speculative_tokens)
        B = len(seqs)
        slots = torch.tensor([s.slot for s in seqs])
        committed_tails = [s.token_ids[self.draft_len[s.request_id]:] for s in seqs]
        tails = [t + p for t, p in zip(committed_tails, prefixes)]  # a guessed path is fed as if committed
        tail_lens = torch.tensor([len(t) for t in tails])  # [B]
        padded_tail = int(tail_lens.max())
        tail_ids = torch.tensor([t + [0] * (padded_tail - len(t)) for t in tails], device=device)  # [B, Tt]
        out = self.model(tail_ids, cache=self.cache, slots=slots)
        root_logits = out.logits[torch.arange(B, device=device), (tail_lens - 1).to(device)]  # [B, V]
        tokens, q = self._pick(root_logits, seqs, greedy, width, 0)  # [B, w], [B, w, V]
        level_tokens, level_q = [tokens], [q]
        scored = self.scores_nodes  # (only auto reads the draft's probabilities: a plain draft skips their softmax)
        prefix_p = [[] for _ in seqs]  # per row, the draft's probability of each prefix token given those before
        if scored:
            for b, prefix in enumerate(prefixes):
                if prefix:
                    start = len(committed_tails[b]) - 1
                    rows = out.logits[b, start:start + len(prefix)].float().softmax(-1)  # [P, V]
                    prefix_p[b] = rows.gather(-1, torch.tensor(prefix, device=device)[:, None])[:, 0].tolist()
            reach = torch.tensor([math.prod(p) for p in prefix_p], device=device)  # [B] P(the whole prefix)
            level_p = [_token_probs(root_logits, q, tokens)]  # [B, w] each node's probability under the draft
            chain_p = reach[:, None] * level_p[0]  # [B, w] each chain's probability so far, prefix included
            expected = B + sum(sum(itertools.accumulate(p, operator.mul)) for p in prefix_p) \
                + float(chain_p.max(1).values.sum())
        # Level d nodes sit at position length + tail_len + d - 1; each chain sees the real tail and its own nodes.
        base_pos = (self.cache.lengths[slots] + tail_lens).to(device)  # [B]
        tail_visible = (torch.arange(padded_tail)[None, :] < tail_lens[:, None]).to(device)  # [B, Tt]
        own_chain = torch.eye(width, dtype=torch.bool, device=device)
        for depth in range(1, K):
            if scored and self.deeper is not None:  # the next level guessed as likely as the last, given the chain
                gain = float((chain_p * level_p[-1]).max(1).values.sum())
                if not self.deeper(B, depth, expected, gain):
                    break
            mask = torch.cat([tail_visible[:, None, :].expand(B, width, padded_tail),
                              own_chain.repeat(1, depth)[None].expand(B, width, width * depth)], dim=2)
            positions = (base_pos + depth - 1)[:, None].expand(B, width)
            out = self.model(level_tokens[-1], positions=positions, cache=self.cache, slots=slots,
                             tree_mask=mask, pending=padded_tail + width * (depth - 1))
            tokens, q = self._pick(out.logits, seqs, greedy, width, depth)
            level_tokens.append(tokens)
            level_q.append(q)
            if scored:
                level_p.append(_token_probs(out.logits, q, tokens))
                chain_p = chain_p * level_p[-1]
                expected += float(chain_p.max(1).values.sum())
        K = len(level_tokens)
        all_tokens = torch.stack(level_tokens, dim=2).cpu()  # [B, w, K]
        all_q = None if greedy else torch.stack(level_q, dim=2)  # [B, w, K, V] (V: the draft head's rows)
        classes = (torch.bucketize(torch.stack(level_p, dim=2).cpu(), torch.tensor(CONFIDENCE_EDGES), right=True)
                   if scored else None)  # [B, w, K]
        trees = []
        for b, seq in enumerate(seqs):
            k = min(budgets[b], K)
            prefix = prefixes[b]
            P = len(prefix)
            top = P - 1  # the node the chains hang from (-1: the last committed token)
            parents = list(range(-1, P - 1)) + [top if d == 0 else P + c * k + d - 1
                                                 for c in range(width) for d in range(k)]
            tokens = torch.cat([torch.tensor(prefix, dtype=all_tokens.dtype), all_tokens[b, :, :k].reshape(-1)])
            probs = None
            if all_q is not None:  # a guessed prefix is one-hot under the draft's q
                probs = all_q[b, :, :k].reshape(width * k, -1)
                if P:
                    probs = torch.cat([torch.nn.functional.one_hot(torch.tensor(prefix, device=probs.device),
                                                                   probs.shape[-1]).to(probs.dtype), probs])
            confidence = None
            if classes is not None:
                confidence = tuple(torch.bucketize(torch.tensor(prefix_p[b]), torch.tensor(CONFIDENCE_EDGES),
                                                   right=True).tolist()) + tuple(classes[b, :, :k].reshape(-1).tolist())
            trees.append(DraftTree(tokens, tuple(parents), probs, node_confidence=confidence))
            self.pending[seq.request_id] = _Pending(len(committed_tails[b]), padded_tail, all_tokens[b].tolist(),
                                                    K - 1, prefix)
        return trees

    def observe(self, seqs, trees, results) -> None:
        """Keep in the draft cache the real tail and the drafted nodes the target committed. Matched by token, not
        by the verifier's node indices: a node's keys and values are right exactly when every token on its path
        is what was committed, whichever tree the target verified (under `auto` a merged one) and whichever
        source guessed the tokens; the rest are caught up on as the next step's tail."""
        rows, kept, n_kept = [], [], []
        width = self.config.num_drafts
        for seq in seqs:
            info = self.pending.pop(seq.request_id, None)
            if info is None:
                continue
            # the step's tokens but the new pending one, which the next step feeds to get its logits
            committed = seq.token_ids[self.draft_len[seq.request_id] + info.tail_len:-1]
            kept_prefix = common_prefix(info.prefix, committed)  # a guessed prefix sits right after the tail
            chain, fed = 0, 0
            if kept_prefix == len(info.prefix):
                below = committed[kept_prefix:]
                for c, tokens in enumerate(info.chains):
                    n = common_prefix(tokens[:info.fed_depth], below)
                    if n > fed:
                        chain, fed = c, n
            offsets = (list(range(info.tail_len + kept_prefix))
                       + [info.padded_tail + width * d + chain for d in range(fed)])
            rows.append(seq.slot)
            kept.append(offsets)
            n_kept.append(len(offsets))
            self.draft_len[seq.request_id] += len(offsets)
        if rows:
            A = max(n_kept)
            kept_t = torch.tensor([k + [k[-1]] * (A - len(k)) for k in kept])  # pad by repeating the last offset
            self.cache.commit(torch.tensor(rows), kept_t, torch.tensor(n_kept))


def _token_probs(logits: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """[B, w] the draft probability of each drafted token: from q when the tokens were sampled from it, else the
    softmax of the logits ([B, V] at the root, [B, w, V] deeper)."""
    if q is not None:
        return q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float()
    probs = logits.float().softmax(-1)
    if probs.dim() == 2:
        return probs.gather(-1, tokens)
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


LIGHT_FORMAT = "q4_0"
"""What a GGUF draft's matrices held in more bits per weight are requantized to (quant.py's lighten)."""

DRAFT_VOCAB = 32768
"""A quantized draft whose vocabulary is over twice this drafts only this many tokens: the most frequent in the
target's own outputs (the shipped ranking for its vocabulary, catalog/token_ranks.py), else the lowest ids (byte-level
BPE numbers tokens in merge order, most frequent first). A draft's output head is a large share of its step
(Qwen2.5-Coder-0.5B: 151,936 x 896 in Q8_0, 144 of the 394 MB a step reads). A token the draft cannot propose only
ends that chain early; the verifier, which sees every token, keeps the output exactly the target's (sampled drafts: q
is 0 beyond the head, a valid draft distribution). Measured for the 0.5B drafting for the 1.5B (held-out code prompts,
depth-1 agreement with the 1.5B's greedy token / one draft level, Intel Xeon VM, one thread, loaded): whole head
0.944 / 33.2 ms, the ranking's first 32,768 0.917 / 23.9 ms, 65,536 0.937 / 27.3 ms; the lowest 65,536 ids (the rule
before) 0.892 / 27.4 ms. At 32k the head's share is ~1 ms of the level (8k: 22.7 ms, 0.773): more tokens than that
buy little acceptance, fewer lose it (docs/bench/draft_vocab_2026-12-05)."""


class SubsetHead(torch.nn.Module):
    """A draft's output head that scores only `ids` (its own rows of the head, kept once at load) and gives every
    other token a logit of -inf, so that everything after it (top-k, softmax, sampling, races) sees the whole
    vocabulary and never picks a token outside the set."""

    def __init__(self, rows: torch.nn.Module, ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.rows = rows
        self.register_buffer("ids", ids)  # [N] ascending: the vocabulary id of each of rows' outputs
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.rows(x)  # [..., N]
        logits = scores.new_full((*scores.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        return logits.index_copy_(-1, self.ids, scores)


def draft_head(head, ids: list[int]):
    """The head restricted to `ids` (a SubsetHead over copies of their rows; a block-quantized head keeps its
    format); a head with a bias, or whose vocabulary holds no more than these, is returned as it is."""
    from specdecode.model.quant import QuantLinear
    if head.bias is not None or head.out_features <= len(ids):
        return head
    ids_t = torch.tensor(sorted(set(ids)), dtype=torch.long)  # (QuantLinear runs on the CPU)
    if isinstance(head, QuantLinear):
        parts, start = [], 0
        for fmt, weight in zip(head.formats, head.qweights):
            mine = ids_t[(ids_t >= start) & (ids_t < start + weight.shape[0])] - start
            if len(mine):
                parts.append((fmt, weight[mine]))
            start += weight.shape[0]
        rows = QuantLinear(parts, head.in_features, len(ids_t), None, head.value_dtype)
    else:
        rows = torch.nn.Linear(head.in_features, len(ids_t), bias=False, dtype=head.weight.dtype,
                               device=head.weight.device)
        rows.weight.data.copy_(head.weight.data[ids_t.to(head.weight.device)])
        ids_t = ids_t.to(head.weight.device)
    return SubsetHead(rows, ids_t, head.out_features)


def frequent_tokens(tokenizer, vocab_size: int, n: int) -> list[int]:
    """The n tokens a draft over this vocabulary keeps: the shipped ranking's first n, else ids 0..n-1."""
    from specdecode.catalog.token_ranks import ranked_tokens, vocabulary_fingerprint

    ranked = ranked_tokens(vocabulary_fingerprint(tokenizer.get_vocab()))
    if ranked is None:
        return list(range(n))
    return [t for t in ranked if t < vocab_size][:n]


def _build(config, context) -> DraftModelProposer:
    from pathlib import Path

    from specdecode.model.gguf import find_gguf, release_pages, same_gguf_tokenizer
    from specdecode.model.loading import load_model, read_config
    from specdecode.model.packed_store import keep_packed, store_for
    from specdecode.model.quant import lighten, speculator_format
    from specdecode.model.tokenizer import Tokenizer
    from specdecode.speculation.compat import check_compatible

    draft_dir = Path(config.model)
    draft_cfg = read_config(draft_dir)  # a Hugging Face directory or a GGUF (what a catalog name resolves to)
    if not same_gguf_tokenizer(context.target_dir, draft_dir):  # (else: the same token map, known in ~10 ms)
        check_compatible(context.tokenizer, Tokenizer(draft_dir, draft_cfg.eos_token_ids), context.target.config,
                         draft_cfg)
    # Beside a block-quantized target the draft's matrices are quantized too, on the same fused kernels: a GGUF
    # draft's as shipped, any other's to Q8_0.
    quantization = speculator_format(context.target)
    if quantization is not None and find_gguf(draft_dir) is not None:
        quantization = "gguf"
    draft = load_model(draft_dir, dtype=context.dtype, device=context.device, quantization=quantization, keep=False)
    vocab = (frequent_tokens(context.tokenizer, draft_cfg.vocab_size, DRAFT_VOCAB)
             if quantization is not None and draft_cfg.vocab_size > 2 * DRAFT_VOCAB else None)
    proposer = DraftModelProposer(DraftModelConfig(str(draft_dir), config.num_speculative_tokens, config.num_drafts,
                                                   vocab), draft)
    if quantization == "gguf":  # a GGUF draft's heavier matrices (Q5_0, Q8_0, Q6_K, ...) in Q4_0: a cheaper step
        store = store_for(find_gguf(draft_dir))
        lighten(draft, LIGHT_FORMAT, store)
        keep_packed(draft, store)  # (its restricted head is made and packed at every start: 32k rows)
        release_pages(find_gguf(draft_dir))
    return proposer


METHOD = Method("draft_model", _build, model="draft", model_required=True, options=("num_drafts",),
                nodes_per_level=lambda config: config.num_drafts, draft_memory="decoder",
                cache_margin=lambda config: 2 + config.num_drafts * config.num_speculative_tokens, trainer="draft")
