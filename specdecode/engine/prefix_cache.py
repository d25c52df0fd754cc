"""Prefix caching and the cache's rows.

Paged (the default, model/cache.py): every full block of keys and values is indexed by its content (the tokens up
to its end), and a joining request whose tokens begin with indexed blocks shares them read-only and prefills only
the rest - blocks of running requests as well as of finished ones, which stay in the pool until it needs the room
(least recently released first). Slots layout: a row keeps its keys and values after its request leaves, and a new
request whose prompt begins with what a free row holds takes that row and prefills only the rest.

Either way a chat's next turn finds what its previous turn left, and requests that share a long system prompt find
it. The reused positions are the target's own keys and values for the same tokens: with the batch-invariant
kernels (the default) they are the numbers a fresh prefill would compute, bit for bit, so outputs are the same with
the cache on or off. SlotPool hands out the rows and remembers what each free row held last (in the slots layout
that is the reusable content; paged, EAGLE's own per-row state still follows it).
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
    preemptions: int = 0
    """Running sequences whose blocks were taken back when the pool ran short (recomputed when they rejoin)."""


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

    def take_slot(self, slot: int) -> None:
        """Take this free slot (one that choose() returned)."""
        if slot in self.held:
            del self.held[slot]
        else:
            self.empty.remove(slot)

    def take(self, prompt: list[int]) -> tuple[int, int]:
        """A free slot for a request with this prompt, and how many of its first tokens that slot already holds
        (at most len(prompt) - 1: the last prompt token is always run, for its logits)."""
        slot, reused = self.choose(prompt)
        self.take_slot(slot)
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
