"""Lookahead decoding (Fu et al., 2024): the target's own Jacobi iterations over a window of future positions
produce n-grams; the pooled n-grams that start with the last token are verified as a tree, in the same target
pass that runs the next Jacobi iteration.

The window is W columns of up to N - 1 guessed tokens (levels). Column i's level-0 token sits i + 1 places after
the pending token and sees the level-0 tokens before it; its level-l token sits l places higher and sees its own
column below it. That is a tree (level 0 a chain, each column hanging from its level-0 node), so the window rides
in the verifying pass as a lookahead branch (DraftTree.lookahead): unverified nodes whose outputs, the target's
argmax above each column's top, come back after the pass. A full column plus its output is an N-gram; it goes to
the pool (keyed by its first token, least recently seen dropped first) and the column moves up a level.

Per step the speculation controller's draft length k (from measured costs and acceptance) sets the shape:
n-grams of k + 1 tokens (N = k + 1), a window of ceil(W * k / K) columns and ceil(G * k / K) pooled guesses, so
that a cheap step is a small pass. k = 0 is plain decoding (the window waits). The pool also takes the prompt's
and the committed text's n-grams (the reference implementation's POOL_FROM_PROMPT, extended to the output).
Guesses are deterministic (one-hot drafts): greedy output equals plain decoding and sampling stays lossless.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import random

import torch

from specdecode.errors import ConfigError
from specdecode.speculation.methods import Method
from specdecode.speculation.proposers.base import NO_FEATURES, WithoutDraftCache
from specdecode.speculation.tree import DraftTree, LookaheadBranch, merge_paths


@dataclasses.dataclass
class LookaheadConfig:
    """Lookahead options (the reference implementation's LEVEL, WINDOW_SIZE, GUESS_SET_SIZE)."""

    ngram: int = 5
    """N: tokens per pooled n-gram at full depth (the window has N - 1 levels)."""
    window: int = 7
    """W: window columns at full depth."""
    guesses: int = 7
    """G: pooled n-grams verified per step at full depth."""
    pool_per_key: int = 16
    """n-grams kept per first token (the least recently seen is dropped first)."""
    seed: int = 0
    """Seed of the tokens that start new window columns (drawn from the sequence's own tokens)."""

    def __post_init__(self):
        for name in ("window", "guesses", "pool_per_key"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"lookahead: {name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.ngram, int) or self.ngram < 2:
            raise ConfigError(f"lookahead: ngram (N) must be an integer >= 2, got {self.ngram!r}")

    @property
    def max_depth(self) -> int:
        return self.ngram - 1

    def shape(self, k: int) -> tuple[int, int, int]:
        """(levels, window columns, guesses) of a step drafting k levels (k <= max_depth)."""
        return k, math.ceil(self.window * k / self.max_depth), math.ceil(self.guesses * k / self.max_depth)

    def pass_nodes(self, k: int) -> int:
        """The most nodes a step drafting k levels adds to the target pass (window + guesses)."""
        levels, window, guesses = self.shape(k)
        return (window + guesses) * levels


class NgramPool:
    """n-grams keyed by their first token: for each key, continuations in least- to most-recently-seen order."""

    def __init__(self, per_key: int):
        self.per_key = per_key
        self.table: dict[int, collections.OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram: list[int] | tuple[int, ...]) -> None:
        if len(ngram) < 2:
            return
        entries = self.table.setdefault(ngram[0], collections.OrderedDict())
        continuation = tuple(ngram[1:])
        entries.pop(continuation, None)
        entries[continuation] = None  # most recent last
        if len(entries) > self.per_key:
            entries.popitem(last=False)

    def guesses(self, key: int, count: int, depth: int) -> list[tuple[int, ...]]:
        """Up to `count` distinct continuations of `key` cut to `depth` tokens, most recently seen first."""
        out: list[tuple[int, ...]] = []
        for continuation in reversed(self.table.get(key, ())):
            cut = continuation[:depth]
            if cut not in out:
                out.append(cut)
                if len(out) == count:
                    break
        return out


class _State:
    """One sequence's window and pool."""

    def __init__(self, config: LookaheadConfig):
        self.columns: list[list[int]] = []  # column i: its tokens from level 0 up
        self.pool = NgramPool(config.pool_per_key)
        self.random = random.Random(config.seed)
        self.pooled_until = 0  # n-grams starting before this position of the sequence are pooled
        self.tops: list[int] = []  # branch node of each fed column's top (last step)
        self.levels = 0  # levels of the last step's window
        self.ngram = config.ngram

    def pool_text(self, tokens: list[int]) -> None:
        """Pool the n-grams of the committed text that are complete now."""
        n = self.ngram
        for start in range(self.pooled_until, len(tokens) - n + 1):
            self.pool.add(tokens[start:start + n])
        self.pooled_until = max(self.pooled_until, len(tokens) - n + 1)

    def branch(self, tokens: list[int], levels: int, width: int) -> LookaheadBranch:
        """The window as a lookahead branch of `width` columns, each `levels` tall at most."""
        while len(self.columns) < width:  # a new column starts from one of the sequence's own tokens
            self.columns.append([tokens[self.random.randrange(len(tokens))]])
        ids: list[int] = []
        parents: list[int] = []
        for i in range(width):
            del self.columns[i][:-levels]  # keep the newest levels
            ids.append(self.columns[i][0])
            parents.append(i - 1)  # level 0 is a chain
        self.tops = list(range(width))
        for i in range(width):
            for token in self.columns[i][1:]:
                parents.append(self.tops[i])
                self.tops[i] = len(ids)
                ids.append(token)
        self.levels = levels
        return LookaheadBranch(torch.tensor(ids, dtype=torch.long), tuple(parents))

    def advance(self, outputs: list[int]) -> None:
        """One Jacobi iteration done: each fed column gains the target's token above its top; a full column
        becomes an n-gram of the pool and moves up a level."""
        for i, top in enumerate(self.tops):
            column = self.columns[i]
            column.append(outputs[top])
            if len(column) > self.levels:
                self.pool.add(column)
                del column[0]


class LookaheadProposer(WithoutDraftCache):
    feature_request = NO_FEATURES

    def __init__(self, config: LookaheadConfig):
        self.config = config
        self.states: dict[str, _State] = {}

    def add(self, seqs) -> None:
        for seq in seqs:
            state = self.states[seq.request_id] = _State(self.config)
            state.pool_text(seq.token_ids)

    def remove(self, seq) -> None:
        self.states.pop(seq.request_id, None)

    def propose(self, seqs, budgets: list[int]) -> list[DraftTree]:
        trees = []
        for seq, budget in zip(seqs, budgets):
            k = min(budget, self.config.max_depth)
            if k <= 0:
                trees.append(DraftTree.empty())
                continue
            state = self.states[seq.request_id]
            state.pool_text(seq.token_ids)
            levels, width, count = self.config.shape(k)
            tokens, parents, _ = merge_paths(state.pool.guesses(seq.token_ids[-1], count, levels))
            branch = state.branch(seq.token_ids, levels, width)
            trees.append(DraftTree(torch.tensor(tokens, dtype=torch.long), tuple(parents), lookahead=branch))
        return trees

    def observe(self, seqs, trees, results) -> None:
        for seq, tree in zip(seqs, trees):
            state = self.states.get(seq.request_id)
            if state is not None and tree.lookahead is not None and tree.lookahead.outputs is not None:
                state.advance(tree.lookahead.outputs)


def lookahead_config(config) -> LookaheadConfig:
    """The Lookahead shape of a speculative_config: N = the deepest draft + 1, W and G as given."""
    return LookaheadConfig(_max_depth(config) + 1, config.lookahead_window, config.lookahead_guesses)


def _max_depth(config) -> int:
    return min(config.num_speculative_tokens, config.lookahead_ngram - 1)


def _build(config, _context) -> LookaheadProposer:
    return LookaheadProposer(lookahead_config(config))


METHOD = Method("lookahead", _build, options=("lookahead_ngram", "lookahead_window", "lookahead_guesses"),
                max_depth=_max_depth,
                nodes_per_level=lambda config: math.ceil(lookahead_config(config).pass_nodes(_max_depth(config))
                                                         / _max_depth(config)),
                pass_nodes=lambda config, k: lookahead_config(config).pass_nodes(k))
