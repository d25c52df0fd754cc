"""Prefix caching: a cache slot keeps its keys and values after its request leaves, and a new request whose prompt
begins with what a free slot holds takes that slot and prefills only the rest.

The caches are preallocated (one row of max_len positions per slot), so what is kept is bounded by the free slots:
taking a slot for a request evicts whatever it held, and the pool gives away the least recently released content
first. A chat's next turn (the history, the model's answer, a new message) finds the slot its previous turn left;
requests that share a long system prompt find it in any slot an earlier one of them left. The reused positions are
the target's own keys and values for the same tokens: with the batch-invariant kernels (the default) they are the
numbers a fresh prefill would compute, bit for bit, so outputs are the same with the cache on or off.
"""
from __future__ import annotations

import collections
import dataclasses

from specdecode.model.cache import common_prefix


@dataclasses.dataclass
class PrefixStats:
    """Counted by every prefill (Prometheus: specdecode:prefix_cache_queries_total / _hits_total)."""

    queries: int = 0
    """Prompt tokens of the requests that took a slot."""
    hits: int = 0
    """Of those, tokens whose keys and values were reused instead of prefilled."""
    chunks: int = 0
    """Chunks of long prompts prefilled between other sequences' steps (chunked prefill; the last one of each
    prompt is its ordinary prefill and is not counted)."""


class SlotPool:
    """The free cache slots and what each one still holds (token ids whose keys and values are in it)."""

    def __init__(self, num_slots: int, enabled: bool = True):
        self.size = num_slots
        self.enabled = enabled
        self.empty: collections.deque[int] = collections.deque(range(num_slots))
        """Free slots that hold nothing reusable."""
        self.held: dict[int, list[int]] = {}
        """Free slots that hold something -> the tokens their rows hold (positions 0..len-1), least recently
        released first."""
        self.stats = PrefixStats()

    @property
    def free(self) -> list[int]:
        return list(self.empty) + list(self.held)

    def grow(self, num_slots: int) -> None:
        """The cache was enlarged (its rows copied over): the new slots are free and empty."""
        self.empty.extend(range(self.size, num_slots))
        self.size = num_slots

    def forget(self) -> None:
        """Drop every prefix the free slots hold (they stay free)."""
        self.empty.extend(self.held)
        self.held.clear()

    def __len__(self) -> int:
        return len(self.empty) + len(self.held)

    def take(self, prompt: list[int]) -> tuple[int, int]:
        """A free slot for a request with this prompt, and how many of its first tokens that slot already holds
        (at most len(prompt) - 1: the last prompt token is always run, for its logits)."""
        slot, reused = self.choose(prompt)
        if slot in self.held:
            del self.held[slot]
        else:
            self.empty.remove(slot)
        return slot, reused

    def choose(self, prompt: list[int]) -> tuple[int, int]:
        """What take(prompt) would return, taking nothing: the slot holding the longest beginning of the prompt;
        else an empty slot; else the one released longest ago (its content is evicted)."""
        best, best_len = None, 0
        for slot, tokens in self.held.items():
            n = common_prefix(tokens, prompt)
            if n > best_len:
                best, best_len = slot, n
        if best is None:
            best = self.empty[0] if self.empty else next(iter(self.held))
        return best, min(best_len, len(prompt) - 1)

    def give_back(self, slot: int, tokens: list[int] | None) -> None:
        """A slot is free again; tokens: what its rows now hold (None: nothing reusable, e.g. after a failure)."""
        if tokens and self.enabled:
            self.held[slot] = list(tokens)
        else:
            self.empty.append(slot)
