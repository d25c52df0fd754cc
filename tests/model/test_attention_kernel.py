"""kernels/attention.cpp: attention over the paged cache, read in place, against a float64 reference; its SIMD paths
give the scalar reference's bits; and a token's output is the same bits however the forward around it is cut
(prefill whole, in chunks of any size, one token at a time, beside other rows, as a draft-tree node whose ancestors
sit at scattered slots), for every cache dtype, 1-40 query rows, 1 and 2 threads, contexts crossing blocks."""
from __future__ import annotations

import pytest
import torch

from specdecode.model.quant import kernels

pytestmark = pytest.mark.skipif(kernels() is None, reason="the kernels cannot be compiled here")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HD = 32


def vector_widths() -> list[int]:
    """The vector widths this build can run attention with (512 where the CPU has AVX-512, and 256)."""
    widths, saved = [], kernels().vector_bits()
    for bits in (512, 256):
        try:
            kernels().set_vector_bits(bits)
            widths.append(bits)
        except RuntimeError:
            pass
    kernels().set_vector_bits(saved) if saved else None
    return widths


def on_every_width(call) -> torch.Tensor:
    """call() on the scalar path, then on every vector width this build runs, each giving the scalar path's bits;
    returns them."""
    scalar = call(False)
    saved = kernels().vector_bits()
    try:
        for bits in vector_widths():
            kernels().set_vector_bits(bits)
            assert torch.equal(call(True), scalar), bits
    finally:
        if saved:
            kernels().set_vector_bits(saved)
    return scalar


def make_cache(rows: int, max_len: int, kv_heads: int, dtype, block_size: int, seed: int = 0, hd: int = HD):
    """Keys [blocks, G, hd, bs] and values [blocks, G, bs, hd] of random numbers, each row's blocks at shuffled
    places in the pool, and the tables [rows, width]."""
    g = torch.Generator().manual_seed(seed)
    width = -(-max_len // block_size)
    blocks = rows * width + 3
    keys = torch.randn(blocks, kv_heads, hd, block_size, generator=g).to(dtype)
    values = torch.randn(blocks, kv_heads, block_size, hd, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[:rows * width].view(rows, width).contiguous()
    return keys, values, tables


def positions_of(keys, values, table, n):
    """Keys and values [G, n, hd] of a row's first n positions, in order (float64)."""
    bs = keys.shape[3]
    k = torch.stack([keys[table[p // bs], :, :, p % bs] for p in range(n)], 1).double()
    v = torch.stack([values[table[p // bs], :, p % bs, :] for p in range(n)], 1).double()
    return k, v


def reference(q, keys, values, tables, lengths, pending, visible, H, G, T):
    """float64 softmax attention with an explicit mask: q [B*T, H*hd] -> [B*T, H*hd]."""
    B, fresh, hd = len(lengths), pending + T, keys.shape[2]
    out = torch.empty(B * T, H * hd, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b]) + fresh
        k, v = positions_of(keys, values, tables[b], n)
        for t in range(T):
            seen = torch.zeros(n, dtype=torch.bool)
            seen[:int(lengths[b])] = True
            if visible is None:
                seen[int(lengths[b]):int(lengths[b]) + pending + t + 1] = True
            else:
                seen[int(lengths[b]):] = visible[b, t]
            for h in range(H):
                qh = q[b * T + t, h * hd:(h + 1) * hd].double() / hd ** 0.5
                s = k[h // (H // G)] @ qh
                s[~seen] = float("-inf")
                out[b * T + t, h * hd:(h + 1) * hd] = torch.softmax(s, 0) @ v[h // (H // G)]
    return out


def random_tree(T: int, pending: int, g) -> torch.Tensor:
    """visible [T, pending + T]: each new node sees the pending positions, its ancestors (a random parent among
    the nodes before it, or none: a root) and itself."""
    parents = [-1 if i == 0 else int(torch.randint(-1, i, (1,), generator=g)) for i in range(T)]
    visible = torch.zeros(T, pending + T, dtype=torch.bool)
    visible[:, :pending] = True
    for i in range(T):
        j = i
        while j >= 0:
            visible[i, pending + j] = True
            j = parents[j]
    return visible


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size, hd", [(16, 32), (5, 32), (64, 32), (16, 40)])
def test_close_to_the_reference_and_simd_is_the_scalar_bits(dtype, block_size, hd):
    g = torch.Generator().manual_seed(1)
    H, G = 6, 2
    for B, T, pending, tree in [(1, 1, 0, False), (2, 5, 0, True), (3, 17, 2, False), (1, 40, 0, False),
                                (2, 9, 3, True), (1, 33, 0, True)]:
        lengths = torch.randint(0, 70, (B,), generator=g)
        keys, values, tables = make_cache(B, int(lengths.max()) + pending + T, G, dtype, block_size, hd=hd)
        visible = torch.stack([random_tree(T, pending, g) for _ in range(B)]) if tree else None
        q = torch.randn(B * T, H * hd, generator=g)
        got = on_every_width(lambda simd: kernels().attention(q, keys, values, tables, lengths, pending, visible, H, G,
                                                              T, use_simd=simd))
        want = reference(q, keys, values, tables, lengths, pending, visible, H, G, T)
        assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4), (got.double() - want).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_tokens_bits_do_not_depend_on_how_the_forward_is_cut(dtype, threads):
    """A 75-token prompt's outputs, computed whole, in chunks of 1, 7 and 32, and beside another row."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(2)
        H, G, n = 4, 1, 75
        keys, values, tables = make_cache(2, 96, G, dtype, 16)
        q = torch.randn(n, H * HD, generator=g)
        whole = kernels().attention(q, keys, values, tables[:1], torch.tensor([0]), 0, None, H, G, n)
        for chunk in (1, 7, 32):
            parts = []
            for s in range(0, n, chunk):
                # what lies past the chunk is not written yet: other numbers than the whole prefill found there
                k2, v2 = keys.clone(), values.clone()
                for p in range(s + chunk, 96):
                    k2[tables[0, p // 16], :, :, p % 16] = torch.randn(G, HD, generator=g).to(dtype)
                    v2[tables[0, p // 16], :, p % 16, :] = torch.randn(G, HD, generator=g).to(dtype)
                parts.append(kernels().attention(q[s:s + chunk], k2, v2, tables[:1], torch.tensor([s]), 0, None, H,
                                                 G, min(chunk, n - s)))
            assert torch.equal(torch.cat(parts), whole), chunk
        # beside another row (same keys through another table would differ: give it the same table)
        pair = kernels().attention(torch.cat([q[40:45], q[40:45]]), keys, values, tables[[0, 0]],
                                   torch.tensor([40, 40]), 0, None, H, G, 5)
        assert torch.equal(pair[:5], whole[40:45]) and torch.equal(pair[5:], whole[40:45])
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tree_node_is_its_token_decoded_after_its_ancestors(dtype):
    """A tree node whose ancestors sit at scattered fresh slots gives the bits of the same token decoded with those
    ancestors committed at consecutive positions (what commit does when the path is accepted)."""
    g = torch.Generator().manual_seed(3)
    H, G, prefix, T = 6, 2, 29, 9
    keys, values, tables = make_cache(1, 64, G, dtype, 16)
    visible = random_tree(T, 0, g)[None]
    q = torch.randn(T, H * HD, generator=g)
    tree = kernels().attention(q, keys, values, tables, torch.tensor([prefix]), 0, visible, H, G, T)
    bs = keys.shape[3]
    for node in range(T):
        path = visible[0, node].nonzero().flatten().tolist()  # its ancestors and itself, in order
        # a second cache: the same prefix, then the path's keys and values at consecutive positions
        k2, v2 = keys.clone(), values.clone()
        for depth, slot in enumerate(path):
            src, dst = prefix + slot, prefix + depth
            k2[tables[0, dst // bs], :, :, dst % bs] = keys[tables[0, src // bs], :, :, src % bs]
            v2[tables[0, dst // bs], :, dst % bs, :] = values[tables[0, src // bs], :, src % bs, :]
        decoded = kernels().attention(q[node:node + 1], k2, v2, tables, torch.tensor([prefix + len(path) - 1]), 0,
                                      None, H, G, 1)
        assert torch.equal(decoded, tree[node:node + 1]), node


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompts_cache_and_logits_are_the_same_bits_however_it_is_prefilled(dtype):
    """Through a whole (tiny, quantized) model: a 70-token prompt prefilled whole, in chunks of 1, 5 and 16, and
    beside another prompt in the same forward leaves the same cache entries and gives the same logits."""
    from tests.model.test_paged_cache import model

    m = model(True)
    ids = torch.randint(3, 90, (1, 70), generator=torch.Generator().manual_seed(4))

    def prefill(chunk: int, beside: bool = False):
        cache = m.make_cache(2, 80, block_size=16, num_blocks=12, dtype=dtype)
        logits = []
        with torch.inference_mode():
            for start in range(0, ids.shape[1], chunk):
                part = ids[:, start:start + chunk]
                if beside:  # a second row, its own prompt, in the same forwards
                    part = torch.cat([part, torch.randint(3, 90, part.shape)])
                out = m(part, cache=cache, slots=torch.tensor([0, 1][:part.shape[0]])).logits
                logits.append(out[:1])
                cache.advance(torch.tensor([0, 1][:part.shape[0]]), part.shape[1])
        keys = torch.stack([cache.k[layer][cache.tables[0, :5]] for layer in range(len(cache.k))])
        return torch.cat(logits, 1), keys

    whole, whole_keys = prefill(70)
    assert whole_keys.dtype == dtype
    for chunk, beside in ((1, False), (5, False), (16, False), (16, True), (70, True)):
        logits, keys = prefill(chunk, beside)
        assert torch.equal(logits, whole), (chunk, beside)
        assert torch.equal(keys, whole_keys), (chunk, beside)


def test_tokens_written_after_pending_ones_are_the_tokens_of_one_forward():
    """A forward whose new tokens follow `pending` uncommitted ones (a draft's later levels) writes them after those
    and gives the logits and cache entries of one forward over all of them (the drafts' caches rely on it: a write
    at the wrong place costs only acceptance, which no exactness test sees)."""
    from tests.model.test_paged_cache import model

    m = model(True)
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(5))
    whole_cache = m.make_cache(1, 32, block_size=16, num_blocks=4)
    parts_cache = m.make_cache(1, 32, block_size=16, num_blocks=4)
    with torch.inference_mode():
        for cache in (whole_cache, parts_cache):
            m(ids[:, :7], cache=cache)
            cache.advance(torch.tensor([0]), 7)
        whole = m(ids[:, 7:], cache=whole_cache).logits
        m(ids[:, 7:10], cache=parts_cache)  # three draft tokens, not committed
        causal = torch.tril(torch.ones(2, 5, dtype=torch.bool), diagonal=3)[None]  # [1, 2, pending + 2]
        later = m(ids[:, 10:], cache=parts_cache, pending=3, tree_mask=causal).logits
    assert torch.equal(later, whole[:, 3:])
    for parts_keys, whole_keys in zip(parts_cache.k, whole_cache.k):
        assert torch.equal(parts_keys[parts_cache.tables[0, 0]], whole_keys[whole_cache.tables[0, 0]])
