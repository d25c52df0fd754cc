"""Static, preallocated KV cache with a committed length per row.

A forward pass writes the keys/values of its new tokens at [length, length + T) of each row without moving
`length`; the caller then either advances the row (plain decoding), commits a chosen subset of those slots
(the accepted path of a draft tree), or does nothing (everything written is dead and is overwritten next time).
"""
from __future__ import annotations

import torch


class KVCache:
    """Per-layer keys [slots, kv_heads, head_dim, max_len], values [slots, kv_heads, max_len, head_dim] and
    committed lengths [slots].

    Keys are stored transposed, so that the scores of a few new queries over a row's first L positions are one
    plain matrix product with a contiguous-rowed [head_dim, L] operand: in bfloat16 on CPU that is 3-10x faster
    than reading keys [L, head_dim] transposed (and than scaled_dot_product_attention for one query).
    """

    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.k = [torch.zeros(slots, kv_heads, head_dim, max_len, dtype=dtype, device=device)
                  for _ in range(num_layers)]
        self.v = [torch.zeros(slots, kv_heads, max_len, head_dim, dtype=dtype, device=device)
                  for _ in range(num_layers)]
        self.max_len = max_len
        self.device = torch.device(device)
        # Lengths live on the host: the engine needs them to size every step, and a device copy is made per
        # forward (one small transfer, no synchronisation).
        self.lengths = torch.zeros(slots, dtype=torch.long)  # [slots]

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    def write(self, layer: int, slots: torch.Tensor, write_pos: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor) -> None:
        """Store new keys/values. slots [B], write_pos [B, T], k_new/v_new [B, kv_heads, T, head_dim]."""
        # Advanced indices around slices put the indexed dims first: [B, T, kv_heads, head_dim] for both.
        # (An indexed write does not convert dtypes as a slice copy does: the cache may be float32 under bfloat16.)
        self.k[layer][slots[:, None], :, :, write_pos] = k_new.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][slots[:, None], :, write_pos] = v_new.transpose(1, 2).to(self.v[layer].dtype)

    def write_block(self, layer: int, first_slot: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store new keys/values [B, kv_heads, T, head_dim] of slots first_slot.. at positions start..start+T-1."""
        B, T = k_new.shape[0], k_new.shape[2]
        self.k[layer][first_slot:first_slot + B, :, :, start:start + T] = k_new.transpose(2, 3)
        self.v[layer][first_slot:first_slot + B, :, start:start + T] = v_new

    def read(self, layer: int, rows: slice | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, kv_heads, head_dim, length] (transposed) and values [B, kv_heads, length, head_dim] of the
        first `length` positions of `rows` (a slice: views, no copy; a tensor of slots: a gathered copy)."""
        return self.k[layer][rows, :, :, :length], self.v[layer][rows, :, :length]

    def advance(self, slots: torch.Tensor, n: torch.Tensor | int) -> None:
        """Make the first n freshly written positions of each row part of its committed prefix."""
        self.lengths[slots.cpu()] += n if isinstance(n, int) else n.cpu()

    def commit(self, slots: torch.Tensor, kept: torch.Tensor, n_kept: torch.Tensor) -> None:
        """Keep chosen fresh positions of each row and drop the rest.

        slots [B]; kept [B, A]: offsets (from the row's length) of the fresh positions to keep, in order;
        n_kept [B]: how many of them are valid. Kept entry i moves to offset i; the entries past n_kept are
        copied too (that keeps every shape static) but stay beyond the new length, so they are dead.
        """
        if kept.shape[1] == 0:
            return
        if kept.shape[1] == 1 and not kept.any():
            self.advance(slots, n_kept)  # plain decoding: each row keeps its one fresh position, already in place
            return
        offsets = torch.arange(kept.shape[1])
        if bool(((kept == offsets) | (offsets >= n_kept[:, None])).all()):
            self.advance(slots, n_kept)  # the kept positions are already in place (a chain's accepted prefix)
            return
        slots_dev = slots.to(self.device)
        base = self.lengths[slots.cpu()].to(self.device)[:, None]  # [B, 1]
        src = (base + kept.to(self.device)).clamp_(max=self.max_len - 1)  # [B, A]
        dst = (base + torch.arange(kept.shape[1], device=self.device)).clamp_(max=self.max_len - 1)  # [B, A]
        rows = slots_dev[:, None]
        for k, v in zip(self.k, self.v):  # gathers make a copy first, so overlaps are safe
            k[rows, :, :, dst] = k[rows, :, :, src]
            v[rows, :, dst] = v[rows, :, src]
        self.advance(slots, n_kept)

    def rollback(self, slots: torch.Tensor, lengths: torch.Tensor | int) -> None:
        """Shorten rows to the given committed lengths; the positions after them are dead."""
        self.lengths[slots.cpu()] = lengths if isinstance(lengths, int) else lengths.cpu()

    def reset(self, slots: torch.Tensor) -> None:
        self.rollback(slots, 0)

    def copy_slot(self, source: int, targets: list[int], length: int) -> None:
        """Give each target slot the source slot's first `length` positions and that committed length (the
        prompt's prefill shared by several requests, e.g. the choices of one request with n > 1)."""
        rows = torch.tensor(targets, device=self.k[0].device)
        for k, v in zip(self.k, self.v):
            k[rows, :, :, :length] = k[source, :, :, :length]
            v[rows, :, :length] = v[source, :, :length]
        self.lengths[targets] = length

    def copy_into(self, other: "KVCache") -> None:
        """Copy every slot's rows and length into a cache with at least as many slots and positions."""
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
