"""Prompt lookup (n-gram) drafting: if the last n tokens occurred earlier in the sequence (prompt or output),
propose the tokens that followed them. The index is updated incrementally, so a step costs the same whatever
the sequence length.
"""
from __future__ import annotations

import dataclasses

import torch

from specdecode.errors import ConfigError
from specdecode.speculation.methods import FORCED_RUN, Method
from specdecode.speculation.proposers.base import NO_FEATURES, WithoutDraftCache
from specdecode.speculation.tree import DraftTree, chain_parents


@dataclasses.dataclass
class NgramConfig:
    """Prompt-lookup options (vLLM's names)."""

    num_speculative_tokens: int = 8
    """Most tokens proposed per step."""
    prompt_lookup_max: int = 4
    """Longest suffix n-gram matched (tried first)."""
    prompt_lookup_min: int = 1
    """Shortest suffix n-gram matched."""

    def __post_init__(self):
        if self.num_speculative_tokens < 1:
            raise ConfigError("num_speculative_tokens must be >= 1 for the ngram method")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")


class _NgramIndex:
    """For each n, the first and the most recent position that follows each n-gram (only n-grams that have a
    successor)."""

    def __init__(self, sizes: range):
        self.sizes = sizes
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in sizes}
        self.indexed_until = 0  # n-grams ending before this position are indexed

    def update(self, tokens: list[int]) -> None:
        # An n-gram ending at e (tokens[e-n:e]) is indexed once tokens[e] exists, i.e. for e < len(tokens).
        for end in range(max(self.indexed_until, 1), len(tokens)):
            for n in self.sizes:
                if end >= n:
                    seen = self.tables[n].setdefault(tuple(tokens[end - n:end]), [end, end])
                    seen[1] = end
        self.indexed_until = max(self.indexed_until, len(tokens))

    def lookup(self, tokens: list[int], k: int, min_match: int = 1) -> tuple[list[int], int]:
        """(what followed the longest earlier occurrence of tokens' last n tokens, n), n >= min_match; ([], 0) if
        none."""
        for n in reversed(self.sizes):
            if n < min_match:
                break
            if len(tokens) <= n:
                continue
            seen = self.tables[n].get(tuple(tokens[-n:]))
            if seen is not None:
                first, last = seen
                # The most recent match, unless it is so close to the end that it cannot supply k tokens (as when
                # the text repeats itself): then the first one, whose continuation is usually complete.
                start = last if len(tokens) - last >= k else first
                return tokens[start:start + k], n
        return [], 0


class NgramProposer(WithoutDraftCache):
    trees_rewritable = True
    feature_request = NO_FEATURES

    def __init__(self, config: NgramConfig):
        self.config = config
        self.indices: dict[str, _NgramIndex] = {}

    def add(self, seqs) -> None:
        sizes = range(self.config.prompt_lookup_min, self.config.prompt_lookup_max + 1)
        for seq in seqs:
            self.indices[seq.request_id] = _NgramIndex(sizes)

    def remove(self, seq) -> None:
        self.indices.pop(seq.request_id, None)

    def propose(self, seqs, budgets: list[int]) -> list[DraftTree]:
        trees = []
        for seq, budget in zip(seqs, budgets):
            k = min(budget, self.config.num_speculative_tokens)
            if k <= 0:
                trees.append(DraftTree.empty())
                continue
            index = self.indices[seq.request_id]
            index.update(seq.token_ids)
            guess, n = index.lookup(seq.token_ids, k)
            trees.append(DraftTree(torch.tensor(guess, dtype=torch.long), chain_parents(len(guess)), confidence=n)
                         if guess else DraftTree.empty())
        return trees

    def draft_after(self, seq, tokens: list[int], k: int, min_match: int = 1) -> list[int]:
        """Up to k tokens guessed to follow `tokens` (the sequence's tokens and then a run it has not emitted yet,
        such as what a grammar forces), looked up in the sequence's index from a match of at least min_match
        trailing tokens (at most prompt_lookup_max are asked for)."""
        index = self.indices[seq.request_id]
        index.update(seq.token_ids)
        return index.lookup(tokens, k, min(min_match, self.config.prompt_lookup_max))[0]

    def observe(self, seqs, trees, results) -> None:
        pass  # the index catches up lazily in propose


def _build(config, _context) -> NgramProposer:
    return NgramProposer(NgramConfig(config.num_speculative_tokens, config.prompt_lookup_max,
                                     config.prompt_lookup_min))


METHOD = Method("ngram", _build, options=("prompt_lookup_max", "prompt_lookup_min"), forced_run=FORCED_RUN)
