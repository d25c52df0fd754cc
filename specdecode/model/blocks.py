"""The pool of a paged KV cache: fixed-size blocks of positions shared by every sequence, with reference counts and
an index of the full blocks by content, so that sequences whose tokens begin the same way share those blocks.

A block's content is named by (the id of the content before it, the block's tokens): keys compared exactly (a dict
of tuples, no hash that could collide), and a chain of them is a prefix. A block nobody references but whose
content is indexed stays in the pool as "cached": a later prompt that begins the same way takes it back; the pool
evicts cached blocks least recently released first when it needs a block and none is empty.
"""
from __future__ import annotations

import collections
import itertools

import numpy


BLOCK_SIZE = 16
"""Positions per block of a paged cache (vLLM's default)."""


class CacheFull(RuntimeError):
    """The pool has fewer free blocks than a step needs (the scheduler admits and preempts so that it does not)."""


ROOT = 0
"""The content id before a sequence's first block."""


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refs = numpy.zeros(num_blocks, dtype=numpy.int64)
        """Table entries naming each block (an array, so that a batch's counts are one vectorized lookup)."""
        self.empty: collections.deque[int] = collections.deque(range(num_blocks))
        """Unreferenced blocks with no indexed content, the next one handed out first: freed blocks go to the front,
        so the blocks ever used (the pool's resident memory, model/cache.py's lazy_zeros) stay as few as the most
        held at once."""
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        """Unreferenced blocks whose content is indexed, least recently released first."""
        self.by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        """(content id before the block, its tokens) -> the block holding that content."""
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.content_id: dict[int, int] = {}
        """Indexed block -> the id its content goes by (the key of the block after it starts with it)."""
        self._ids = itertools.count(ROOT + 1)
        self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks a sequence can get now (empty ones, then cached ones evicted)."""
        return len(self.empty) + len(self.cached)

    @property
    def used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.available

    def allocate(self) -> int:
        if self.empty:
            block = self.empty.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            self.unindex(block)
            self.evictions += 1
        else:
            raise CacheFull(f"all {self.num_blocks} KV-cache blocks are in use")
        self.refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.cached[block]
        self.refs[block] += 1

    def decref(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.key_of:
                self.cached[block] = None
            else:
                self.empty.appendleft(block)

    def shared(self, block: int) -> bool:
        """Whether writing into the block would change what someone else reads: another sequence references it,
        or its content is indexed for later prompts."""
        return self.refs[block] > 1 or block in self.key_of

    def index(self, block: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Index a full block's content (its tokens after the content `parent`); returns the content's id. If
        another block already holds that content, it stays the indexed one (this block is left as it is). A block
        indexed before under another key holds other content now: that key is dropped."""
        key = (parent, tokens)
        if self.key_of.get(block, key) != key:
            self.unindex(block)
        holder = self.by_key.get(key)
        if holder is None:
            holder = block
            self.by_key[key] = block
            self.key_of[block] = key
            self.content_id[block] = next(self._ids)
        return self.content_id[holder]

    def unindex(self, block: int) -> None:
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.by_key[key]
            del self.content_id[block]
            if block in self.cached:  # unreferenced: now simply empty
                del self.cached[block]
                self.empty.appendleft(block)

    def lookup(self, parent: int, tokens: tuple[int, ...]) -> int | None:
        return self.by_key.get((parent, tokens))

    def clear_index(self) -> None:
        """Forget every indexed content (the cached blocks become empty)."""
        for block in list(self.key_of):
            self.unindex(block)

    def check(self, tables_refs: collections.Counter) -> str | None:
        """None when the reference counts are exactly what the block tables hold (tables_refs: block -> how many
        table entries name it) and every block is in exactly one of: referenced, cached, empty."""
        for block in range(self.num_blocks):
            if self.refs[block] != tables_refs.get(block, 0):
                return f"block {block} has {self.refs[block]} references but {tables_refs.get(block, 0)} table entries"
        free = list(self.empty) + list(self.cached)
        if len(set(free)) != len(free) or any(self.refs[b] for b in free):
            return "a free block is listed twice or is still referenced"
        referenced = int((self.refs > 0).sum())
        if len(free) + referenced != self.num_blocks:
            return f"blocks leaked: {len(free)} free and {referenced} referenced of {self.num_blocks}"
        return None
