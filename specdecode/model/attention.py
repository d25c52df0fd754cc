"""Attention of one forward's new tokens over the KV cache in torch: where they are written, what they see, which
kernel. Kept-quantized models on CPU do not come here: their layers, attention included, run in the kernels
(kernels/layer.cpp, kernels/attention.cpp: the paged cache read in place, every width); this path serves float
weights, other devices, and is the reference those kernels are tested against.

Decode and verify steps (a few new tokens per row) run as two plain matrix products over the cache (keys stored
transposed, see cache.py) with a softmax between, in the cache's dtype (float32 on CPU for float models, see
LlamaForCausalLM.kv_dtype): on CPU, for so few queries, that is 2-10x faster than scaled_dot_product_attention
(which in bfloat16 costs ~0.7 ms per layer for one query over 500 positions), and float32 matrix products read the
cache's strided prefix in place where bfloat16 ones copy it first. Prefills (many queries) go to
scaled_dot_product_attention.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specdecode.model.cache import KVCache

SMALL_STEP_TOKENS = 32
"""New tokens per row up to which attention runs as matrix products over the cache (decode and verify steps)."""


def attention_over_cache(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor,
                         blocked: torch.Tensor | None, window: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of a few queries over a cached context.

    q [B, heads, T, hd], keys_t [B, kv_heads, hd, L], values [B, kv_heads, L, hd];
    blocked [B, 1, 1, T, window] bool (True = may not attend) over the last `window` positions, or None;
    scale [1]: 1/sqrt(hd) in the cache's dtype (a 1-d tensor, so that q * scale also converts q to it).
    Returns [B, heads, T, hd] in the cache's dtype.
    """
    B, H, T, hd = q.shape
    kv_heads, L = keys_t.shape[1], keys_t.shape[3]
    group = H // kv_heads
    # The query heads that share a kv head are stacked as rows: grouped-query attention without repeating keys.
    if scale is None:
        scale = torch.full((1,), hd ** -0.5, dtype=keys_t.dtype, device=q.device)
    q = q.reshape(B, kv_heads, group * T, hd) * scale  # scaled and brought to the cache's dtype: one operation
    scores = torch.matmul(q, keys_t)  # [B, kv_heads, group * T, L]
    if blocked is not None:
        scores.view(B, kv_heads, group, T, L)[..., L - window:].masked_fill_(blocked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).view(B, H, T, hd)


class CacheContext:
    """What every layer of one cached forward shares: where to write, what to read, what each token sees.

    Everything here is computed once per forward, not per layer, and nothing per step grows with the context
    except where rows of different lengths share a batch (their mask spans the context). Rows that are a
    contiguous range of slots are read and written through views; rows of equal length write with one slice copy
    and mask only the fresh positions (the prefix is visible to every new token).
    """

    def __init__(self, cache: KVCache, slots: torch.Tensor | None, batch: int, new_tokens: int,
                 tree_mask: torch.Tensor | None, pending: int):
        device = cache.device
        self.cache = cache
        slots = torch.arange(batch) if slots is None else slots.cpu()
        slot_list = slots.tolist()
        first = slot_list[0]
        contiguous = slot_list == list(range(first, first + batch))
        lengths = cache.lengths[slots]  # [B], host
        self.lengths = lengths  # [B] committed lengths (host), for the fused layers (kernels/layer.cpp)
        self.slot_ids = slots  # [B] (host)
        self.pending, self.tree_mask = pending, tree_mask
        length_list = lengths.tolist()
        fresh = pending + new_tokens  # positions after the committed prefix this forward can see
        self.context_len = max(length_list) + fresh
        cache.reserve(slot_list, [n + fresh for n in length_list])  # blocks for the new positions (paged)
        self.tables = cache.tables[slots]  # [B, width] the rows' blocks (host), for the fused layers
        same_length = min(length_list) == max(length_list)
        self.slots = slots.to(device)
        lengths = lengths.to(device)
        new = torch.arange(new_tokens, device=device)
        self.write_pos = lengths[:, None] + pending + new  # [B, T]
        # Slots layout: the rows as a slice when they are slots first..first+B-1 (read through views, no gather),
        # and the start of every row's new tokens when it is the same for all rows (one slice write), else None.
        # Paged: the rows' block tables, and each new token's address.
        self.write_start = None
        if not cache.paged:
            self.rows = slice(first, first + batch) if contiguous else self.slots
            self.write_at = (self.slots[:, None].expand(batch, new_tokens), self.write_pos)
            if same_length and contiguous:
                self.write_start = length_list[0] + pending
        self.small_step = new_tokens <= SMALL_STEP_TOKENS
        keys = cache.k[0]  # [blocks, kv_heads, hd, block_size]
        self.q_scale = torch.full((1,), keys.shape[2] ** -0.5, dtype=keys.dtype, device=device)  # see attention_over_cache
        self.is_causal = False  # a prefill from empty rows: causal attention over the new tokens only
        self.mask = None  # [B, 1, T, L] bool, True = may attend (scaled_dot_product_attention); None = all
        self.blocked = None  # [B, 1, 1, T, W] bool, True = may not attend, over the last W positions
        self.window = 0
        if tree_mask is None and same_length and new_tokens == 1:
            return  # one new token per row after equal prefixes: it sees every position
        if tree_mask is None and same_length and length_list[0] == 0 and pending == 0:
            self.is_causal = True
            return
        if same_length and self.small_step:
            if tree_mask is None:  # causal among the fresh positions
                visible = torch.arange(fresh, device=device)[None, None, :] <= pending + new[None, :, None]
                visible = visible.expand(batch, new_tokens, fresh)
            else:
                visible = tree_mask.to(device)  # [B, T, fresh]
            self.blocked, self.window = ~visible[:, None, None], fresh
            return
        rel = torch.arange(self.context_len, device=device)[None, :] - lengths[:, None]  # [B, L]: offset from prefix end
        is_fresh = (rel >= 0) & (rel < fresh)
        if tree_mask is None:
            fresh_visible = rel[:, None, :] <= pending + new[None, :, None]  # [B, T, L]: causal
        else:
            node = rel.clamp(0, fresh - 1)[:, None, :].expand(batch, new_tokens, self.context_len)
            fresh_visible = torch.gather(tree_mask.to(device), 2, node)  # [B, T, L]
        self.mask = ((rel < 0)[:, None, :] | (is_fresh[:, None, :] & fresh_visible))[:, None]  # [B, 1, T, L]
        if self.small_step:
            self.blocked, self.window = ~self.mask[:, :, None], self.context_len

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """Paged: the rows' blocks [B, blocks] on the device (the fused kernels read the host tables instead)."""
        return self.cache.gather_table(self.slot_ids, self.context_len)

    @functools.cached_property
    def write_at(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Paged: each new token's block and offset, [B, T] each."""
        return self.cache.address(self.slot_ids, self.write_pos)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this layer's new keys/values [B, kv_heads, T, hd] and attend: q [B, heads, T, hd] -> same shape."""
        cache = self.cache
        if self.write_start is not None:
            cache.write_block(layer, self.rows.start, self.write_start, k, v)
        else:
            cache.write(layer, *self.write_at, k, v)
        if self.is_causal:  # the context is exactly the new tokens
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        keys_t, values = cache.read(layer, self.rows, self.context_len)
        if self.small_step:
            return attention_over_cache(q, keys_t, values, self.blocked, self.window, self.q_scale).to(q.dtype)
        return F.scaled_dot_product_attention(q.to(values.dtype), keys_t.transpose(2, 3), values,
                                              attn_mask=self.mask, enable_gqa=True).to(q.dtype)
