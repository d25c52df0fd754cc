"""The one loop: propose -> verify (one batched target pass over every sequence's tree) -> commit.

Plain decoding is the same loop with empty trees. Between steps the target's cache holds every token of a
sequence but the last (the "pending" token): a step feeds [pending, tree nodes...] per row.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from specdecode.engine.batch import StepBatch
from specdecode.engine.prefix_cache import SlotPool
from specdecode.model.cache import BLOCK_SIZE, KVCache
from specdecode.engine.sequence import Sequence
from specdecode.model.llama import LlamaForCausalLM
from specdecode.sampling import (DRAW, params_tensors, penalize, position_uniforms, processed_probs, race_tokens,
                                 raced, sample_rows, token_logprobs)
from specdecode.speculation.proposers.base import NO_FEATURES, Proposer, TargetFeatures
from specdecode.speculation.tree import DraftTree
from specdecode.speculation.verify import verify_step


@dataclasses.dataclass
class StepReport:
    """The one stats record of a step: each sequence's SpecStats takes its row (and, when the sequence leaves, the
    engine's totals take those), the Prometheus metrics and the speculation controller read the whole of it."""

    width: int
    """Tokens per row of the target pass (1 + the largest tree)."""
    draft_time: float
    """Seconds spent proposing."""
    verify_time: float
    """Seconds spent in the target pass, verification and commit."""
    draft_lens: list[int]
    """Draft tokens (tree nodes) verified for each sequence."""
    accepted_lens: list[int]
    """Draft tokens accepted for each sequence."""
    join_time: float = 0.0
    """Seconds spent registering sequences that drafted for the first time (their draft prefill), not in
    draft_time: a one-off cost, not a cost of drafting."""
    draft_depths: list[int] = dataclasses.field(default_factory=list)
    """Levels of each sequence's tree (0 = no draft)."""


class StepRunner:
    def __init__(self, target: LlamaForCausalLM, proposer: Proposer | None):
        self.target = target
        self.proposer = proposer
        self.cache = None
        self.max_len = 0
        self.last_report: StepReport | None = None
        self.mutated = False
        """Whether the last prefill or step got as far as changing the cache or the sequences (if it raised before
        that, running it again is safe)."""
        self.joined: set[str] = set()  # requests the proposer holds
        self.chunked_prefill = True
        """Whether a long prompt arriving while others decode is prefilled in chunks between their steps."""
        self.prefix_caching = True
        """Whether a request may reuse keys and values of its prompt's beginning that the cache holds: paged, the
        full blocks any request (running or finished) left indexed; slots layout, what a free slot still holds
        (engine/prefix_cache.py)."""
        self.block_size: int | None = BLOCK_SIZE
        """Positions per block of the target's paged KV cache; None: the slots layout (a row of max_len each)."""
        self.num_blocks: int | None = None
        """The paged pool's size in blocks (from the capacity plan); None: every row at max_len."""
        self.kv_dtype: torch.dtype | None = None
        """What the target's cache stores (None: the model's kv_dtype)."""
        self.slots = SlotPool(0)
        """The cache's free rows and what they held last (rebuilt empty with the cache)."""
        # Target hidden states the proposer reads (EAGLE, Medusa), taken from the passes that verify.
        self.features = proposer.feature_request if proposer is not None else NO_FEATURES
        self.tree_room = 0
        """The most draft nodes the cache has room for beyond a sequence's tokens (ensure_capacity's tree_size)."""

    def ensure_capacity(self, slots: int, max_len: int, tree_size: int) -> None:
        """Caches for `slots` sequences of up to max_len tokens, plus room for one verified tree."""
        self.max_len = max_len
        self.tree_room = max(self.tree_room, tree_size)
        need = max_len + tree_size + 2
        cache = self.cache
        if type(cache) is KVCache and cache.paged:  # tables grow; the pool keeps every block where it is
            if cache.num_slots < slots or cache.max_len < need:
                cache.resize(slots, need)
                self.slots.grow(cache.num_slots)
            if self.num_blocks is None:
                cache.grow_pool(cache.num_slots * cache.tables.shape[1])
        elif cache is None or cache.num_slots < slots or cache.max_len < need:
            old = cache
            slots, need = max(slots, old.num_slots if old else 0), max(need, old.max_len if old else 0)
            paging = {} if self.block_size is None else {"block_size": self.block_size, "num_blocks": self.num_blocks}
            if self.kv_dtype is not None:
                paging["dtype"] = self.kv_dtype
            self.cache = self.target.make_cache(slots, need, **paging)
            if type(old) is not KVCache or type(self.cache) is not KVCache:  # (tensor-parallel caches start empty)
                self.slots = SlotPool(self.cache.num_slots, self.prefix_caching)
            else:  # a larger cache keeps what the old one held, so the prefixes free slots hold stay reusable
                old.copy_into(self.cache)
                self.slots.grow(self.cache.num_slots)
        if self.proposer is not None:
            paged = type(self.cache) is KVCache and self.cache.paged
            self.proposer.ensure_cache(slots, need, self.cache.num_blocks * self.cache.block_size if paged else None)

    @property
    def paged(self) -> bool:
        return type(self.cache) is KVCache and self.cache.paged

    # -- blocks: admission, reservation, preemption -------------------------------------------------------------

    def place(self, seq: Sequence) -> tuple[int, int, list[int]]:
        """Where a joining sequence would go, taking nothing: (its row, how many of its first tokens the cache
        already holds, the blocks holding them). Paged: the longest run of full indexed blocks that begins its tokens
        (at most len - 1: the last token is run for its logits); slots layout: what the free row that held the
        longest beginning of them still holds. A proposer that keeps per-position state of its own (EAGLE) may
        lower it: it holds that state only for what the row's last request left."""
        slot, held = self.slots.choose(seq.token_ids)
        if not self.paged:
            return slot, self.reusable(slot, held), []
        blocks = self.cache.match(seq.token_ids, len(seq.token_ids) - 1) if self.prefix_caching else []
        if self.features.wanted:
            blocks = blocks[:self.reusable(slot, min(held, len(blocks) * self.cache.block_size))
                            // self.cache.block_size]
        return slot, len(blocks) * self.cache.block_size, blocks

    def admission_blocks(self, seq: Sequence, blocks: list[int], prefill_end: int) -> int:
        """Blocks of the pool a joining sequence takes: those its prefill (written up to prefill_end: a batch is
        padded to its longest row) and its first step need, and the cached (unreferenced) ones it would adopt."""
        if not self.paged:
            return 0
        bs, pool = self.cache.block_size, self.cache.pool
        end = min(max(prefill_end, len(seq.token_ids) + self.tree_room + 1), self.cache.max_len)
        return -(-end // bs) - len(blocks) + sum(1 for b in blocks if pool.refs[b] == 0)

    def blocks_to_finish(self, seq: Sequence) -> int:
        """Blocks a sequence being prefilled in chunks still takes for the rest of its prompt and its first step."""
        if not self.paged:
            return 0
        return self.cache.blocks_needed(seq.slot, len(seq.token_ids) + self.tree_room + 1)

    @property
    def rides_chunks(self) -> bool:
        """Whether a long prompt's chunk can go in a step's target pass (not where the proposer reads the target's
        hidden states: a chunk alone hands them over, prefill_chunk)."""
        return not self.features.wanted

    def chunk_fits_beside(self, seqs: list[Sequence], budgets: list[int], seq: Sequence, tokens: int) -> bool:
        """Whether the pool has the blocks for a step of seqs and the next `tokens` of seq's prompt together."""
        if not self.paged:
            return True
        width = 1 + (self.tree_room if any(budgets) else 0)
        slots = [s.slot for s in seqs]
        need = self.cache.blocks_needed_many(slots, (self.cache.lengths[slots] + width).tolist())
        return need + self.cache.blocks_needed(seq.slot, seq.prefilled + tokens) <= self.cache.pool.available

    def chunk_fits(self, seq: Sequence, tokens: int) -> bool:
        """Whether the pool has the blocks for the next `tokens` of a prompt being prefilled in chunks."""
        return not self.paged or self.cache.blocks_needed(seq.slot, seq.prefilled + tokens) <= self.cache.pool.available

    def step_headroom(self, running: list[Sequence]) -> int:
        """Blocks the next step of the running sequences takes (each one's tree room beyond its tokens)."""
        if not self.paged:
            return 0
        room, slots = self.tree_room + 1, [s.slot for s in running]
        return self.cache.blocks_needed_many(slots, (self.cache.lengths[slots] + room).tolist())

    def take(self, seq: Sequence, slot: int, reused: int, blocks: list[int]) -> None:
        """Give a joining sequence its row and the blocks it reuses (held from now on: not evicted)."""
        self.slots.take_slot(slot)
        seq.slot = slot
        if self.paged:
            self.cache.adopt(slot, blocks)
        seq.reused = seq.prefilled = reused

    def shortfall(self, seqs: list[Sequence], budgets: list[int]) -> int:
        """Blocks missing (in the target's pool or the proposer's) for one step of these sequences; 0: it fits."""
        if not self.paged:
            return 0
        cache = self.cache
        width = 1 + (self.tree_room if any(budgets) else 0)
        most = len(seqs) * (2 + width // cache.block_size)  # a new block or two a row, and a copy on write
        if most <= cache.pool.available:
            short = 0
        else:
            slots = [s.slot for s in seqs]
            need = cache.blocks_needed_many(slots, (cache.lengths[slots] + width).tolist())
            short = need - cache.pool.available
        if self.proposer is not None and any(budgets):
            short = max(short, self.proposer.cache_shortfall(seqs, budgets))
        return max(short, 0)

    def free_row(self, seq: Sequence, reusable: bool = True) -> None:
        """A sequence gives back its row: paged, its full blocks indexed (for later prompts, or for itself when it
        is recomputed) and every block released; slots layout, the row keeps what it holds for a later prompt.
        (reusable False: after a failure, when the rows may be half written.)"""
        if seq.slot < 0:
            return
        held = int(self.cache.lengths[seq.slot]) if reusable else 0
        if self.paged:
            if reusable and self.prefix_caching:
                self.cache.index(seq.slot, seq.token_ids)
            self.cache.release(seq.slot)
        self.slots.give_back(seq.slot, seq.token_ids[:held])
        seq.slot = -1

    def index(self, seqs: list[Sequence]) -> None:
        """Offer the sequences' newly full blocks to the index: a prompt that begins the same way shares them at
        once, while these still run."""
        if self.paged and self.prefix_caching:
            for seq in seqs:
                self.cache.index(seq.slot, seq.token_ids)

    @torch.inference_mode()  # no_grad and also no version counters: less work per operation
    def prefill(self, seqs: list[Sequence]) -> list[str]:
        """Run the prompts and draw each sequence's first token."""
        self.mutated = False
        start = time.perf_counter()
        for seq in seqs:  # (seq.reused: what the cache held, within reusable(); the scheduler set it)
            seq.prefill_tokens = len(seq.token_ids)
            self.slots.stats.queries += len(seq.token_ids)
            self.slots.stats.hits += seq.reused
        everyone, seqs, copies = seqs, *self._shared_prompts(seqs)
        device = self.target.device
        slots = torch.tensor([s.slot for s in seqs])
        self.cache.rollback(slots, torch.tensor([s.prefilled for s in seqs]))
        lens = [len(s.token_ids) - s.prefilled for s in seqs]  # positions this prefill runs
        width = max(lens)
        ids = torch.tensor([s.token_ids[s.prefilled:] + [0] * (width - n) for s, n in zip(seqs, lens)],
                           device=device)
        out = self.target(ids, cache=self.cache, slots=slots, compute_logits=False, hidden_layers=self.features.layers)
        hidden = out.hidden
        last = hidden[torch.arange(len(seqs), device=device), torch.tensor(lens, device=device) - 1]  # [B, D]
        logits = self.target.lm_head(last)  # [B, V]
        self.cache.advance(slots, torch.tensor(lens))
        if copies:  # the requests whose prompt another one in this prefill ran: its cache rows and logits
            for leader, followers in copies.items():
                self.cache.copy_slot(seqs[leader].slot, [f.slot for f in followers], len(seqs[leader].token_ids))
                self.slots.stats.hits += sum(len(f.token_ids) - f.reused for f in followers)
            order = list(range(len(seqs))) + [leader for leader, fs in copies.items() for _ in fs]
            logits = logits[order]
            seqs = seqs + [f for fs in copies.values() for f in fs]
        self.index(seqs)
        roots = self._adjusted_logits(seqs, logits[:, None], [DraftTree.empty()] * len(seqs))[:, 0]
        first = self._sample_roots(seqs, roots)
        logprobs = self._logprobs(seqs, logits[:, None], [[0]] * len(seqs), [[t] for t in first])
        elapsed = time.perf_counter() - start
        self.mutated = True  # from here on the sequences change
        deltas = {}
        for seq, token, lp in zip(seqs, first, logprobs):
            seq.stats.verify_time += elapsed
            deltas[id(seq)] = self._append(seq, [token], lp)
        if self.features.wanted:
            self.proposer.observe_target(seqs, TargetFeatures.select(out, self.features, lens))
        return [deltas[id(seq)] for seq in everyone]

    def _shared_prompts(self, seqs: list[Sequence]) -> tuple[list[Sequence], dict[int, list[Sequence]]]:
        """The sequences whose prompts this prefill must run, and {position among them: the other sequences with the
        same prompt and start}, which take a copy of its cache rows instead of running it again. Only with the
        plain KV cache and a proposer that reads no target features (those would need each copy's hidden
        states too)."""
        if len(seqs) < 2 or self.features.wanted or type(self.cache) is not KVCache:
            return seqs, {}
        first: dict[tuple, int] = {}
        run, copies = [], {}
        for seq in seqs:
            key = (seq.prefilled, tuple(seq.token_ids))
            if key in first:
                copies.setdefault(first[key], []).append(seq)
            else:
                first[key] = len(run)
                run.append(seq)
        return run, copies

    def _join(self, seqs: list[Sequence], budgets: list[int]) -> float:
        """Register with the proposer the sequences about to draft for the first time; returns the seconds taken.
        Joining late means a sequence that never speculates (a large batch, speculation off) never costs a draft
        prefill; the proposer starts from the target's state: the cache holds every token but the pending one."""
        start = time.perf_counter()
        joining = [s for s, b in zip(seqs, budgets) if b and s.request_id not in self.joined]
        if joining:
            self.proposer.add(joining)
            self.joined.update(s.request_id for s in joining)
        return time.perf_counter() - start

    @torch.inference_mode()
    def prefill_chunk(self, seq: Sequence, tokens: int) -> None:
        """Run the next `tokens` tokens of a long prompt into its cache (no token is drawn: the last part goes
        through prefill()). Between chunks the other sequences keep decoding."""
        self.mutated = False
        slot = torch.tensor([seq.slot])
        self.cache.rollback(slot, seq.prefilled)
        ids = torch.tensor([seq.token_ids[seq.prefilled:seq.prefilled + tokens]], device=self.target.device)
        out = self.target(ids, cache=self.cache, slots=slot, compute_logits=False, hidden_layers=self.features.layers)
        self.cache.advance(slot, tokens)
        self.mutated = True
        seq.prefilled += tokens
        self.index([seq])
        if self.features.wanted:
            self.proposer.observe_target([seq], TargetFeatures.select(out, self.features, [tokens]))

    def reusable(self, slot: int, held: int) -> int:
        """Of the `held` leading positions a free slot's target cache holds for a new prompt, how many a prefill may
        keep: a proposer that reads target features and keeps per-position state of its own may hold fewer."""
        limit = self.proposer.held_prefix(slot) if self.features.wanted else None
        return held if limit is None else min(held, limit)

    def release(self, seq: Sequence) -> None:
        """A sequence leaves: free what the proposer holds for it."""
        if seq.request_id in self.joined or self.features.wanted:  # a feature reader holds every sequence
            self.joined.discard(seq.request_id)
            self.proposer.remove(seq)

    def _sample_roots(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        if all(s.params.greedy for s in seqs):
            return logits.argmax(-1).tolist()
        probs = processed_probs(logits, *params_tensors([s.params for s in seqs], device=logits.device))
        keys, positions = [s.random.key for s in seqs], [s.num_generated for s in seqs]
        racing = [i for i, s in enumerate(seqs) if raced(s.params)]
        drawing = [i for i in range(len(seqs)) if i not in set(racing)]
        drawn = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        if racing:
            drawn[racing] = race_tokens(probs[racing], [keys[i] for i in racing],
                                        [positions[i] for i in racing]).to(drawn.device)
        if drawing:
            u = position_uniforms([keys[i] for i in drawing], [positions[i] for i in drawing], 1, DRAW)  # [n, 1]
            drawn[drawing] = sample_rows(probs[drawing], u[:, 0].to(logits.device))
        return drawn.tolist()

    def _grammar_tree(self, seq: Sequence, tree: DraftTree, budget: int) -> DraftTree:
        """A structured request's tree. With a proposer that guesses chains after any run of tokens (draft_after):
        one chain of the tokens the grammar forces (drafted for free) and the proposer's guesses (at most `budget`
        of them) where nothing is forced, each guess cut where the grammar forbids it, up to the tree's room.
        Else the tokens forced next when there are any, or the proposer's tree without the nodes the grammar
        forbids (and their subtrees)."""
        draft_after = getattr(self.proposer, "draft_after", None)
        if draft_after is not None:
            chain: list[int] = []
            match = 1  # a guess right after a forced run must match all of it (a value follows its own key)
            while len(chain) < self.tree_room:
                run = seq.grammar.forced(chain)
                if run:
                    match = len(run)
                else:
                    if budget <= 0:  # (0 also for a sequence the proposer never joined)
                        break
                    guess = draft_after(seq, seq.token_ids + chain, min(budget, self.tree_room - len(chain)), match)
                    run = guess[:max(0, seq.grammar.allowed_prefix(chain + guess) - len(chain))]
                    budget, match = budget - len(run), 1
                    if not run:
                        break
                chain += run
            return DraftTree.chain(torch.tensor(chain[:self.tree_room], dtype=torch.long)) if chain \
                else DraftTree.empty()
        forced = seq.grammar.forced()[:self.tree_room]
        if forced:
            return DraftTree.chain(torch.tensor(forced, dtype=torch.long))
        if not len(tree) or tree.lookahead is not None:
            return tree
        keep = [i for i in range(len(tree)) if seq.grammar.accepts(tree.tokens[tree.path_to(i)].tolist())]
        if len(keep) == len(tree):
            return tree
        if not keep:
            return DraftTree.empty()
        renumbered = {old: new for new, old in enumerate(keep)}
        parents = [renumbered[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in keep]
        probs = tree.draft_probs[keep] if tree.draft_probs is not None else None
        return DraftTree(tokens=tree.tokens[keep], parents=tuple(parents), draft_probs=probs)

    @staticmethod
    def _adjusted_logits(seqs: list[Sequence], logits: torch.Tensor, trees: list[DraftTree]) -> torch.Tensor:
        """logits [B, W, V] of [root, nodes...] per row, with the penalties and logit_bias of the rows that set them
        applied at every node from the output so far plus the node's path, then the grammar's mask of a
        structured request (the raw logits are left as they are: logprobs read them)."""
        rows = [b for b, s in enumerate(seqs) if s.params.penalized or s.grammar is not None]
        if not rows:
            return logits
        logits = logits.clone()
        for b in rows:
            seq, tree = seqs[b], trees[b]
            paths = [[]] + [tree.tokens[tree.path_to(i)].tolist() for i in range(len(tree))]
            rows_b = logits[b, :len(paths)]
            if seq.params.penalized:
                rows_b = penalize(rows_b, seq.params, seq.token_ids[:seq.num_prompt], seq.output_ids, paths)
            if seq.grammar is not None:  # the grammar's mask at every node, from the state after its path
                rows_b = rows_b.masked_fill(~seq.grammar.tree_masks(paths).to(rows_b.device), float("-inf"))
            logits[b, :len(paths)] = rows_b.to(logits.dtype)
        return logits

    @staticmethod
    def _logprobs(seqs: list[Sequence], logits: torch.Tensor, positions: list[list[int]],
                  tokens: list[list[int]]) -> list[list | None]:
        """Per sequence, the TokenLogprob of each new token (None for one that did not ask): token i of row b was
        produced by logits[b, positions[b][i]], the same target pass that chose it."""
        asking = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
        out: list[list | None] = [None] * len(seqs)
        if not asking:
            return out
        rows = [b for b in asking for _ in positions[b]]
        cols = [c for b in asking for c in positions[b]]
        flat = token_logprobs(logits[rows, cols], [t for b in asking for t in tokens[b]],
                              [seqs[b].params.logprobs for b in asking for _ in positions[b]])
        i = 0
        for b in asking:
            out[b], i = flat[i:i + len(positions[b])], i + len(positions[b])
        return out

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list | None = None) -> str:
        before = seq.num_generated
        delta = seq.append(tokens, self.max_len, logprobs)
        seq.stats.emitted_tokens += seq.num_generated - before
        return delta

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], budgets: list[int], chunk: tuple[Sequence, int] | None = None) -> list[str]:
        """One speculative step for every sequence; returns the new text of each. chunk (a long prompt's sequence,
        tokens): the next tokens of that prompt go into its cache in the same target pass (as prefill_chunk)."""
        self.mutated = False
        device = self.target.device
        join_time = 0.0
        if self.proposer is not None and any(budgets):
            join_time = self._join(seqs, budgets)
        t0 = time.perf_counter()
        if self.proposer is not None and any(budgets):
            trees = self.proposer.propose(seqs, budgets)
        else:
            trees = [DraftTree.empty() for _ in seqs]
        if getattr(self.proposer, "trees_rewritable", False) and self.tree_room:
            trees = [self._grammar_tree(s, t, b) if s.grammar is not None and s.params.use_speculation else t
                     for s, t, b in zip(seqs, trees, budgets)]
        t1 = time.perf_counter()

        batch = StepBatch.build([s.token_ids[-1] for s in seqs], trees, [s.slot for s in seqs], self.cache.lengths,
                                device)
        riding = None
        if chunk is not None:
            assert self.rides_chunks, "a proposer that reads the target's features takes chunks alone"
            long, tokens = chunk
            self.cache.rollback(torch.tensor([long.slot]), long.prefilled)
            riding = (long.slot, long.token_ids[long.prefilled:long.prefilled + tokens])
        out = self.target(batch.ids, cache=self.cache, hidden_layers=self.features.layers, chunk=riding,
                          **batch.target_inputs())
        results = verify_step(trees, self._adjusted_logits(seqs, out.logits, trees), [s.params for s in seqs],
                              [s.random.key for s in seqs], [s.num_generated for s in seqs])
        slots, width = batch.slots, batch.width

        A = max(len(r.accepted) for r in results) + 1
        kept = torch.tensor([[0] + [c + 1 for c in r.accepted] + [0] * (A - 1 - len(r.accepted))
                             for r in results])  # [B, A]
        n_kept = [1 + len(r.accepted) for r in results]
        self.mutated = True  # from here on the caches and the sequences change
        self.cache.commit(slots, kept, torch.tensor(n_kept))
        if chunk is not None:
            self.cache.advance(torch.tensor([long.slot]), tokens)
            long.prefilled += tokens
            self.index([long])
        t2 = time.perf_counter()

        report = StepReport(width, t1 - t0, t2 - t1, [len(t) for t in trees], [len(r.accepted) for r in results],
                            join_time, [int(t.depths.max()) + 1 if len(t) else 0 for t in trees])
        emitted = [tree.tokens[result.accepted].tolist() + [result.next_token] for tree, result in zip(trees, results)]
        # the logits that chose each emitted token: the root's, then each accepted node's
        logprobs = self._logprobs(seqs, out.logits, [row[:n] for row, n in zip(kept.tolist(), n_kept)], emitted)
        deltas = []
        for row, (seq, tokens, lp) in enumerate(zip(seqs, emitted, logprobs)):
            seq.stats.record(report, row)
            deltas.append(self._append(seq, tokens, lp))
        self.index(seqs)
        if self.proposer is not None:
            self.proposer.observe(seqs, trees, results)
        if self.features.wanted:  # the hidden states at the root and the accepted path of each row
            self.proposer.observe_target(seqs, TargetFeatures.select(out, self.features, n_kept, kept))
        self.last_report = report
        return deltas
