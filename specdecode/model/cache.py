"""The KV cache: keys and values in blocks of positions, a block table per row (sequence), a committed length per row.

A forward pass writes the keys/values of its new tokens at [length, length + T) of each row without moving
`length`; the caller then either advances the row (plain decoding), commits a chosen subset of those positions
(the accepted path of a draft tree), or does nothing (everything written is dead and is overwritten next time).

Two layouts, one addressing (position p of a row is offset p % block_size of block table[row][p // block_size]):
- paged (block_size < max_len): a pool of blocks shared by all rows (model/blocks.py), allocated as a row grows
  (`reserve`, which every cached forward calls), so memory follows the tokens held; full blocks are indexed by
  content and shared read-only by every row whose tokens begin the same way (`match`, `adopt`, `index`), copied
  on write where a row writes into a block someone else reads;
- slots (block_size = max_len): one preallocated block per row, the table the identity (tensor parallelism, the
  speculators' own small caches, benchmarks of one row).
A position's keys and values are the same numbers in either layout and wherever its block sits: attention reads
them through the table in order of position (the fused kernel, kernels/layer.cpp, and the gather in `read`).
"""
from __future__ import annotations

import collections
import mmap

import numpy
import torch

from specdecode.errors import ConfigError
from specdecode.model.blocks import BLOCK_SIZE, ROOT, BlockPool, CacheFull

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "q8_0": torch.int8}
"""What keys and values may be stored as (the fused kernels widen 16-bit entries exactly and round new ones to
nearest): half the memory of float32 for a little rounding of every cached entry; q8_0 (int8 tensors) a quarter
and a little: each 32 values of a position's key or value as 8-bit integers and a float16 scale stored beside them
(kernels/quant.h's Q8_GROUP layout), read and written by the fused kernels only."""

Q8_GROUP = 32
"""Values per scale of the 8-bit cache (quant.h)."""


def stored_rows(head_dim: int, dtype: torch.dtype) -> int:
    """Values a cache of `dtype` stores per position and kv head: head_dim, and for the 8-bit cache the two bytes of
    each group's scale."""
    if dtype != torch.int8:
        return head_dim
    if head_dim % Q8_GROUP:
        raise ConfigError(f"an 8-bit KV cache (q8_0) needs a head size that is a multiple of {Q8_GROUP}, not "
                          f"{head_dim}: choose float16")
    return head_dim + 2 * head_dim // Q8_GROUP


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros whose memory is taken as it is first written: on the CPU an anonymous memory map (the kernel hands
    out zeroed pages on first touch), so a pool planned for many positions is resident only where blocks were
    used (the pool hands blocks out lowest first and reuses freed ones first, model/blocks.py); elsewhere plain
    zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = 1
    for size in shape:
        count *= size
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes < mmap.PAGESIZE:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the map alive


class KVCache:
    """Per-layer keys [blocks, kv_heads, head_dim, block_size], values [blocks, kv_heads, block_size, head_dim],
    block tables [rows, max_len / block_size] and committed lengths [rows] (both on the host).

    Keys are stored transposed, so that the scores of a few new queries over a block's positions are one plain
    matrix product with a contiguous-rowed [head_dim, positions] operand: in bfloat16 on CPU that is 3-10x faster
    than reading keys [positions, head_dim] transposed (and than scaled_dot_product_attention for one query).
    """

    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 block_size: int | None = None, num_blocks: int | None = None):
        """block_size None (or >= max_len): the slots layout. num_blocks: the paged pool's size (default: enough
        for every row at max_len, the slots layout's memory)."""
        paged = block_size is not None and block_size < max_len
        self.block_size = block_size if paged else max_len
        width = -(-max_len // self.block_size)
        blocks = (num_blocks or slots * width) if paged else slots
        rows = stored_rows(head_dim, dtype)
        self.k = [lazy_zeros((blocks, kv_heads, rows, self.block_size), dtype, device)
                  for _ in range(num_layers)]
        self.v = [lazy_zeros((blocks, kv_heads, self.block_size, rows), dtype, device)
                  for _ in range(num_layers)]
        self.max_len = max_len
        self.device = torch.device(device)
        self.pool = BlockPool(blocks) if paged else None
        self.tables = torch.full((slots, width), -1, dtype=torch.long)  # [rows, width], host
        if not paged:
            self.tables[:, 0] = torch.arange(slots)
        # Lengths live on the host: the engine needs them to size every step, and a device copy is made per
        # forward (one small transfer, no synchronisation).
        self.lengths = torch.zeros(slots, dtype=torch.long)  # [rows]
        self.chains: list[list[int]] = [[] for _ in range(slots)]
        """Per row, the content ids of its leading blocks offered to the pool's index (`index`)."""

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def paged(self) -> bool:
        return self.pool is not None

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer, keys and values."""
        return 2 * len(self.k) * self.k[0][0].numel() * self.k[0].element_size()

    # -- blocks -----------------------------------------------------------------------------------------------

    def _missing(self, slot: int, end: int) -> tuple[list[int], list[int]]:
        """Columns of the row's block table that positions [length, end) need allocated: (absent, shared: copy on
        write)."""
        bs, pool = self.block_size, self.pool
        first = int(self.lengths[slot]) // bs
        absent, shared = [], []
        for i, block in enumerate(self.tables[slot, first:-(-end // bs)].tolist(), first):
            if block < 0:
                absent.append(i)
            elif pool.shared(block):
                shared.append(i)
        return absent, shared

    def blocks_needed(self, slot: int, end: int) -> int:
        """Blocks reserve(slot, end) would take from the pool (0 in the slots layout)."""
        if self.pool is None:
            return 0
        absent, shared = self._missing(slot, min(end, self.max_len))
        return len(absent) + sum(1 for i in shared if self.pool.refs[int(self.tables[slot, i])] > 1)

    def blocks_needed_many(self, slots: list[int], ends: list[int]) -> int:
        """Sum of blocks_needed over rows, vectorized (one pass over the rows' tables, not a loop per row)."""
        if self.pool is None or not slots:
            return 0
        bs = self.block_size
        tables = self.tables[slots]  # [B, W]
        first = (self.lengths[slots] // bs)[:, None]  # [B, 1]
        last = ((torch.tensor(ends).clamp(max=self.max_len) + bs - 1) // bs)[:, None]  # [B, 1] (exclusive)
        column = torch.arange(tables.shape[1])[None, :]  # [1, W]
        in_range = (column >= first) & (column < last)  # [B, W] the blocks the rows write into
        refs = torch.from_numpy(self.pool.refs)[tables.clamp(min=0)]  # [B, W]
        return int((in_range & ((tables < 0) | (refs > 1))).sum())

    def reserve(self, slots: list[int], ends: list[int]) -> None:
        """Make positions [length, end) of each row writable: blocks allocated where the row has none, and a private
        copy of any block in that range someone else reads. Raises CacheFull (changing nothing) when the pool
        cannot give that many blocks, ValueError past max_len."""
        for end in ends:
            if end > self.max_len:
                raise ValueError(f"the KV cache holds {self.max_len} positions per row; this step needs {end}. "
                                 "Allocate a longer cache or generate fewer tokens.")
        if self.pool is None:
            return
        plans = [(slot, *self._missing(slot, end)) for slot, end in zip(slots, ends)]
        need = sum(len(a) + sum(1 for i in s if self.pool.refs[int(self.tables[slot, i])] > 1)
                   for slot, a, s in plans)
        if need > self.pool.available:
            raise CacheFull(f"this step needs {need} more KV-cache blocks; {self.pool.available} of "
                            f"{self.pool.num_blocks} are free")
        for slot, absent, shared in plans:
            for i in absent:
                self.tables[slot, i] = self.pool.allocate()
            for i in shared:
                old = int(self.tables[slot, i])
                if self.pool.refs[old] == 1:  # only the index reads it: drop the indexed content, write in place
                    self.pool.unindex(old)
                    continue
                new = self.pool.allocate()
                for k, v in zip(self.k, self.v):
                    k[new] = k[old]
                    v[new] = v[old]
                self.pool.decref(old)
                self.tables[slot, i] = new

    def release(self, slot: int) -> None:
        """The row holds nothing any more: its blocks go back to the pool (indexed ones stay there, cached)."""
        self.lengths[slot] = 0
        self.chains[slot] = []
        if self.pool is None:
            return
        for block in reversed(self.tables[slot].tolist()):  # a chain's end becomes the first to be evicted
            if block >= 0:
                self.pool.decref(block)
        self.tables[slot] = -1

    def index(self, slot: int, tokens: list[int]) -> None:
        """Offer the row's full committed blocks to the pool's index; tokens: what positions 0.. of the row hold."""
        if self.pool is None:
            return
        bs, chain = self.block_size, self.chains[slot]
        if len(chain) >= len(tokens) // bs:  # nothing newly full (most steps: no read of the lengths tensor)
            return
        full = min(int(self.lengths[slot]), len(tokens)) // bs
        for i in range(len(chain), full):
            parent = chain[-1] if chain else ROOT
            chain.append(self.pool.index(int(self.tables[slot, i]), parent, tuple(tokens[i * bs:(i + 1) * bs])))

    def match(self, tokens: list[int], limit: int) -> list[int]:
        """The blocks whose content is the longest run of full blocks beginning `tokens`, within its first limit."""
        if self.pool is None:
            return []
        bs, blocks, parent = self.block_size, [], ROOT
        for i in range(min(limit, len(tokens)) // bs):
            block = self.pool.lookup(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            if block is None:
                break
            blocks.append(block)
            parent = self.pool.content_id[block]
        return blocks

    def adopt(self, slot: int, blocks: list[int]) -> int:
        """Give an empty row the blocks match() found (shared, read-only) as its committed prefix; returns its
        length."""
        self.release(slot)
        for i, block in enumerate(blocks):
            self.pool.incref(block)
            self.tables[slot, i] = block
            self.chains[slot].append(self.pool.content_id[block])
        self.lengths[slot] = len(blocks) * self.block_size
        return len(blocks) * self.block_size

    def references(self) -> collections.Counter:
        """Block -> how many table entries name it."""
        return collections.Counter(b for b in self.tables.flatten().tolist() if b >= 0)

    def leak(self) -> str | None:
        """None when the pool's counts match the tables (tests and the soak check it after every scenario)."""
        return None if self.pool is None else self.pool.check(self.references())

    # -- reads and writes ---------------------------------------------------------------------------------------

    def address(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks, offsets) on the device, both [B, T], of positions [B, T] of rows slots [B]."""
        slots, positions = slots.cpu(), positions.cpu()
        blocks = self.tables[slots[:, None], positions // self.block_size]
        return blocks.to(self.device), (positions % self.block_size).to(self.device)

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor) -> None:
        """Store new keys/values [B, kv_heads, T, head_dim] at addresses blocks, offsets [B, T] (see address)."""
        self._torch_readable()
        # Advanced indices around slices put the indexed dims first: [B, T, kv_heads, head_dim] for both.
        # (An indexed write does not convert dtypes as a slice copy does: the cache may be float32 under bfloat16.)
        self.k[layer][blocks, :, :, offsets] = k_new.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][blocks, :, offsets] = v_new.transpose(1, 2).to(self.v[layer].dtype)

    def write_block(self, layer: int, first_slot: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Slots layout: store new keys/values [B, kv_heads, T, head_dim] of rows first_slot.. at positions
        start..start+T-1."""
        self._torch_readable()
        B, T = k_new.shape[0], k_new.shape[2]
        self.k[layer][first_slot:first_slot + B, :, :, start:start + T] = k_new.transpose(2, 3)
        self.v[layer][first_slot:first_slot + B, :, start:start + T] = v_new

    def _torch_readable(self) -> None:
        if self.k[0].dtype == torch.int8:
            raise ConfigError("the 8-bit KV cache (q8_0) is read and written by the fused CPU kernels only (a GGUF "
                              "kept quantized on the CPU); use float16 here")

    def gather_table(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        """Paged: the blocks [B, n] on the device holding positions [0, length) of the rows (absent ones as block
        0: those positions are past every row's context and masked)."""
        n = -(-length // self.block_size)
        return self.tables[slots.cpu(), :n].clamp(min=0).to(self.device)

    def read(self, layer: int, rows: slice | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, kv_heads, head_dim, length] (transposed) and values [B, kv_heads, length, head_dim] of the
        first `length` positions of `rows`: slots layout, a slice of rows (views, no copy) or a tensor of slots
        (a gathered copy); paged, a gather_table (a copy, block by block in order of position)."""
        self._torch_readable()
        if self.pool is None:
            return self.k[layer][rows, :, :, :length], self.v[layer][rows, :, :length]
        B, n = rows.shape
        keys = self.k[layer][rows]  # [B, n, G, hd, bs]
        values = self.v[layer][rows]  # [B, n, G, bs, hd]
        G, hd, bs = keys.shape[2], keys.shape[3], keys.shape[4]
        keys = keys.permute(0, 2, 3, 1, 4).reshape(B, G, hd, n * bs)[..., :length]
        values = values.permute(0, 2, 1, 3, 4).reshape(B, G, n * bs, hd)[:, :, :length]
        return keys, values

    def row(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [kv_heads, head_dim, length] (transposed) and values [kv_heads, length, head_dim] of a row's first
        positions, in either layout."""
        rows = torch.tensor([slot])
        keys, values = self.read(layer, self.gather_table(rows, length) if self.paged else rows, length)
        return keys[0], values[0]

    # -- lengths ------------------------------------------------------------------------------------------------

    def advance(self, slots: torch.Tensor, n: torch.Tensor | int) -> None:
        """Make the first n freshly written positions of each row part of its committed prefix."""
        self.lengths[slots.cpu()] += n if isinstance(n, int) else n.cpu()

    def commit(self, slots: torch.Tensor, kept: torch.Tensor, n_kept: torch.Tensor) -> None:
        """Keep chosen fresh positions of each row and drop the rest.

        slots [B]; kept [B, A]: offsets (from the row's length) of the fresh positions to keep, in order;
        n_kept [B]: how many of them are valid. Kept entry i moves to offset i.
        """
        if kept.shape[1] == 0:
            return
        if kept.shape[1] == 1 and not kept.any():
            self.advance(slots, n_kept)  # plain decoding: each row keeps its one fresh position, already in place
            return
        offsets = torch.arange(kept.shape[1])
        valid = offsets < n_kept.cpu()[:, None]  # [B, A]
        if bool(((kept == offsets) | ~valid).all()):
            self.advance(slots, n_kept)  # the kept positions are already in place (a chain's accepted prefix)
            return
        slots = slots.cpu()
        base = self.lengths[slots][:, None]  # [B, 1]
        rows = slots[:, None].expand_as(kept)[valid]  # [N]
        src_blocks, src_offsets = self.address(rows, (base + kept.cpu())[valid][:, None])  # [N, 1] each
        dst_blocks, dst_offsets = self.address(rows, (base + offsets).expand_as(kept)[valid][:, None])
        for k, v in zip(self.k, self.v):  # gathers make a copy first, so overlaps are safe
            k[dst_blocks, :, :, dst_offsets] = k[src_blocks, :, :, src_offsets]
            v[dst_blocks, :, dst_offsets] = v[src_blocks, :, src_offsets]
        self.advance(slots, n_kept)

    def rollback(self, slots: torch.Tensor, lengths: torch.Tensor | int) -> None:
        """Shorten rows to the given committed lengths; the positions after them are dead."""
        slots = slots.cpu()
        self.lengths[slots] = lengths if isinstance(lengths, int) else lengths.cpu()
        for slot in slots.reshape(-1).tolist():
            del self.chains[slot][int(self.lengths[slot]) // self.block_size:]

    def reset(self, slots: torch.Tensor) -> None:
        self.rollback(slots, 0)

    def copy_slot(self, source: int, targets: list[int], length: int) -> None:
        """Give each target row the source row's first `length` positions and that committed length (the
        prompt's prefill shared by several requests, e.g. the choices of one request with n > 1): paged, its
        full blocks shared and its last partial block copied. Raises CacheFull (changing nothing) when the pool
        cannot give every target that copy."""
        if self.pool is None:
            rows = torch.tensor(targets, device=self.k[0].device)
            for k, v in zip(self.k, self.v):
                k[rows, :, :, :length] = k[source, :, :, :length]
                v[rows, :, :length] = v[source, :, :length]
            self.lengths[targets] = length
            return
        full, partial = divmod(length, self.block_size)
        shared = self.tables[source, :full].tolist()
        # the blocks only the targets name come back when they are released below
        held = collections.Counter(b for t in targets for b in self.tables[t].tolist() if b >= 0)
        freed = sum(1 for b, n in held.items() if self.pool.refs[b] == n)
        if partial and len(targets) > self.pool.available + freed:
            raise CacheFull(f"copying a prompt's last block into {len(targets)} rows needs {len(targets)} KV-cache "
                            f"blocks; {self.pool.available} of {self.pool.num_blocks} are free")
        for target in targets:
            self.release(target)
            for i, block in enumerate(shared):
                self.pool.incref(block)
                self.tables[target, i] = block
            self.chains[target] = list(self.chains[source][:full])
            self.lengths[target] = full * self.block_size
            if partial:
                self.reserve([target], [length])
                new, old = int(self.tables[target, full]), int(self.tables[source, full])
                for k, v in zip(self.k, self.v):
                    k[new] = k[old]
                    v[new] = v[old]
            self.lengths[target] = length

    def resize(self, slots: int, max_len: int) -> None:
        """Paged: room for more rows and longer ones (the tables grow; the pool grows to the slots layout's memory
        if it was sized that way, keeping every block where it is)."""
        old_slots, old_width = self.tables.shape
        width = max(old_width, -(-max_len // self.block_size))
        slots = max(slots, old_slots)
        tables = torch.full((slots, width), -1, dtype=torch.long)
        tables[:old_slots, :old_width] = self.tables
        self.tables = tables
        self.lengths = torch.cat([self.lengths, torch.zeros(slots - old_slots, dtype=torch.long)])
        self.chains += [[] for _ in range(slots - old_slots)]
        self.max_len = max(self.max_len, max_len)

    def grow_pool(self, num_blocks: int) -> None:
        """Paged: a larger pool, every block kept where it is."""
        old = self.num_blocks
        if num_blocks <= old:
            return
        for layer in range(len(self.k)):
            k = lazy_zeros((num_blocks, *self.k[layer].shape[1:]), self.k[layer].dtype, self.k[layer].device)
            v = lazy_zeros((num_blocks, *self.v[layer].shape[1:]), self.v[layer].dtype, self.v[layer].device)
            k[:old], v[:old] = self.k[layer], self.v[layer]
            self.k[layer], self.v[layer] = k, v
        self.pool.refs = numpy.concatenate([self.pool.refs, numpy.zeros(num_blocks - old, dtype=self.pool.refs.dtype)])
        self.pool.empty.extend(range(old, num_blocks))
        self.pool.num_blocks = num_blocks

    def copy_into(self, other: "KVCache") -> None:
        """Slots layout: copy every row and length into a cache with at least as many rows and positions."""
        S, L = self.num_slots, self.max_len
        for k, v, k2, v2 in zip(self.k, self.v, other.k, other.v):
            k2[:S, :, :, :L] = k
            v2[:S, :, :L] = v
        other.lengths[:S] = self.lengths


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences (how much of a slot's rows a prompt can keep)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


__all__ = ["BLOCK_SIZE", "KV_DTYPES", "CacheFull", "KVCache", "common_prefix"]
