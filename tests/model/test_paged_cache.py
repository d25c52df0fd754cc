"""The paged KV cache: a position's keys and values are the same numbers whatever block they sit in, so a forward's
logits are bitwise those of the slots layout (fused quantized kernels and the float path alike), blocks shared by
content are copied before anyone writes into them, and the pool's counts always match the tables."""
import os

import pytest
import torch

from specdecode.model.blocks import BLOCK_SIZE, BlockPool, CacheFull
from specdecode.model.cache import KVCache
from specdecode.model.quant import quantize_linears

from tests.compiled import kernels_or_skip
from tests.model.test_linear import tiny_model


def model(quantized: bool):
    m = tiny_model(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)
    if quantized:
        kernels_or_skip()
        quantize_linears(m, "q8_0")
        assert m.fused_layers(m.make_cache(1, 8)) is not None
    return m


def run(m, cache, prompts, steps):
    """Prefill every prompt into its row (rows in a scrambled order), then decode `steps` chains of 3 tokens as
    verify passes with a tree mask, committing a ragged subset; returns the logits of every pass."""
    out = []
    with torch.inference_mode():
        for row in (2, 0, 1):
            ids = torch.tensor([prompts[row]])
            out.append(m(ids, cache=cache, slots=torch.tensor([row])).logits)
            cache.advance(torch.tensor([row]), len(prompts[row]))
        tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])  # a root, two children
        for step in range(steps):
            ids = torch.tensor([[5 + step, 7, 9], [11, 13 + step, 2], [3, 4, 6 + step]])
            out.append(m(ids, cache=cache, slots=torch.tensor([1, 2, 0]), tree_mask=tree.expand(3, 3, 3)).logits)
            cache.commit(torch.tensor([1, 2, 0]), torch.tensor([[0, 2], [0, 1], [0, 0]]), torch.tensor([2, 2, 1]))
    return out


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("block_size", [4, 5, 16])
def test_paged_logits_are_bitwise_the_slots_layouts(quantized, block_size):
    m = model(quantized)
    prompts = [list(range(1, 12)), list(range(20, 26)), list(range(30, 53))]
    slots = run(m, m.make_cache(3, 64), prompts, 6)
    # a pool with spare blocks, and the first ones taken by rows allocated in another order: placement differs
    paged_cache = m.make_cache(3, 64, block_size=block_size, num_blocks=40)
    paged = run(m, paged_cache, prompts, 6)
    assert paged_cache.paged and paged_cache.pool.used < 40
    for a, b in zip(slots, paged):
        assert torch.equal(a, b)
    assert paged_cache.leak() is None
    assert paged_cache.lengths.tolist() == [11 + 6, 6 + 12, 23 + 12]


def test_blocks_follow_the_tokens_and_shared_blocks_are_copied_before_a_write():
    m = model(True)
    cache = m.make_cache(4, 64, block_size=4, num_blocks=12)
    tokens = list(range(1, 11))  # 10 tokens: two full blocks and a partial one
    with torch.inference_mode():
        m(torch.tensor([tokens]), cache=cache, slots=torch.tensor([0]))
        cache.advance(torch.tensor([0]), 10)
    assert cache.pool.used == 3
    cache.index(0, tokens)
    assert len(cache.pool.key_of) == 2  # the full blocks, by content
    blocks = cache.match(tokens + [99], limit=10)
    assert blocks == cache.tables[0, :2].tolist()
    assert cache.adopt(1, blocks) == 8 and cache.pool.used == 3  # shared, not copied
    with torch.inference_mode():  # row 1 continues differently from position 8: a block of its own
        own = m(torch.tensor([[50, 51, 52]]), cache=cache, slots=torch.tensor([1])).logits
        cache.advance(torch.tensor([1]), 3)
        # the same positions recomputed from scratch in a fresh row agree bit for bit
        fresh = m.make_cache(1, 64)
        m(torch.tensor([tokens[:8]]), cache=fresh)
        fresh.advance(torch.tensor([0]), 8)
        again = m(torch.tensor([[50, 51, 52]]), cache=fresh).logits
    assert torch.equal(own, again)
    assert cache.pool.used == 4 and cache.tables[1, :2].tolist() == blocks
    for ends in ([12, 12], [16, 20], [9, 30]):  # the vectorized count agrees with the row-by-row one
        assert cache.blocks_needed_many([0, 1], ends) == sum(map(cache.blocks_needed, [0, 1], ends))
    # row 1 rolls back into a shared block and writes there: it gets a private copy, row 0 is untouched
    cache.rollback(torch.tensor([1]), 6)
    # the vectorized count sees the copy on write too (row 1's [6, 8) is in the block row 0 reads)
    assert cache.blocks_needed_many([0, 1], [12, 8]) == cache.blocks_needed(0, 12) + cache.blocks_needed(1, 8) == 1
    before = [k[blocks[1]].clone() for k in cache.k]
    with torch.inference_mode():
        m(torch.tensor([[60, 61]]), cache=cache, slots=torch.tensor([1]))
    assert cache.tables[1, 1] != blocks[1]
    assert all(torch.equal(k[blocks[1]], b) for k, b in zip(cache.k, before))
    assert cache.leak() is None
    cache.release(0)
    cache.release(1)
    assert cache.pool.used == 0 and len(cache.pool.cached) == 2  # the indexed blocks stay for later prompts
    assert cache.match(tokens, limit=9) == blocks
    assert cache.leak() is None


def test_a_full_pool_refuses_before_changing_anything():
    cache = KVCache(1, 2, 1, 32, 4, block_size=4, num_blocks=3)
    cache.reserve([0], [8])
    assert cache.pool.used == 2
    with pytest.raises(CacheFull):
        cache.reserve([0, 1], [12, 4])  # needs two, one is left
    assert cache.pool.used == 2 and cache.tables[1].tolist() == [-1] * 8
    with pytest.raises(ValueError, match="holds 32 positions"):
        cache.reserve([1], [33])
    # unreferenced indexed blocks stay cached, and are evicted (the end of a chain first) when nothing is empty
    cache.lengths[0] = 8
    cache.index(0, list(range(8)))
    first = int(cache.tables[0, 0])
    cache.release(0)
    assert len(cache.pool.cached) == 2 and cache.pool.used == 0
    cache.reserve([1], [4])
    assert cache.pool.evictions == 0  # the empty block first
    cache.reserve([0], [4])
    assert cache.pool.evictions == 1 and cache.match(list(range(8)), 8) == [first]
    assert cache.leak() is None


def test_forks_share_full_blocks_and_copy_the_partial_one():
    m = model(True)
    cache = m.make_cache(3, 64, block_size=4, num_blocks=20)
    with torch.inference_mode():
        m(torch.tensor([list(range(1, 11))]), cache=cache, slots=torch.tensor([0]))
        cache.advance(torch.tensor([0]), 10)
        cache.copy_slot(0, [1, 2], 10)
        assert cache.tables[1, :2].tolist() == cache.tables[0, :2].tolist() != cache.tables[1, :3].tolist()
        assert cache.pool.used == 5
        logits = m(torch.tensor([[7], [7], [7]]), cache=cache, slots=torch.tensor([0, 1, 2])).logits
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    assert cache.leak() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_cache_runs_the_fused_kernels_and_stays_batch_and_placement_invariant(dtype):
    m = model(True)
    prompts = [list(range(1, 12)), list(range(20, 26)), list(range(30, 53))]
    slots_cache = m.make_cache(3, 64, dtype=dtype)
    assert slots_cache.k[0].dtype == dtype and m.fused_layers(slots_cache) is not None
    slots = run(m, slots_cache, prompts, 4)
    paged = run(m, m.make_cache(3, 64, block_size=5, num_blocks=40, dtype=dtype), prompts, 4)
    for a, b in zip(slots, paged):
        assert torch.equal(a, b)
    wide = run(m, m.make_cache(3, 64, dtype=torch.float32), prompts, 4)  # close, not equal (16-bit rounding)
    assert not all(torch.equal(a, b) for a, b in zip(slots, wide))
    assert all((a - b).abs().max() < 0.1 * b.abs().max() for a, b in zip(slots, wide))
    # a row alone gives the numbers it gives in the batch
    alone = m.make_cache(1, 64, dtype=dtype)
    with torch.inference_mode():
        logits = m(torch.tensor([prompts[2]]), cache=alone).logits
    assert torch.equal(logits, slots[0])


def test_an_adopted_cached_block_is_never_evicted_while_referenced():
    """A cached (unreferenced, indexed) block taken back by a prompt that begins the same way is referenced again:
    a pool under pressure evicts other cached blocks and refuses before handing that one out."""
    cache = KVCache(1, 3, 1, 32, 4, block_size=4, num_blocks=4)
    cache.reserve([0], [12])
    cache.lengths[0] = 12
    cache.index(0, list(range(12)))
    blocks = cache.tables[0, :3].tolist()
    cache.release(0)
    assert len(cache.pool.cached) == 3 and cache.pool.available == 4
    assert cache.adopt(1, cache.match(list(range(12)) + [99], 12)) == 12  # all three back, referenced
    assert cache.pool.available == 1 and not cache.pool.cached
    with pytest.raises(CacheFull):
        cache.reserve([2], [8])  # two blocks, one free: nothing adopted may be evicted for it
    cache.reserve([2], [4])
    assert cache.tables[2, 0] not in blocks and cache.tables[1, :3].tolist() == blocks
    assert cache.leak() is None and cache.pool.evictions == 0
    cache.release(2)
    cache.rollback(torch.tensor([1]), 8)
    cache.reserve([1], [12])  # row 1 rewrites its last block (indexed, no one else's): unindexed, written in place
    assert cache.tables[1, 2] == blocks[2] and cache.match(list(range(12)), 12) == blocks[:2]
    cache.reserve([0], [4])
    assert cache.tables[0, 0] not in blocks and cache.leak() is None
    cache.release(1)
    cache.release(0)
    assert cache.pool.used == 0 and cache.leak() is None


def test_a_block_indexed_again_under_another_key_keeps_only_the_new_one():
    cache = KVCache(1, 1, 1, 32, 4, block_size=4, num_blocks=2)
    cache.reserve([0], [4])
    block = int(cache.tables[0, 0])
    first = cache.pool.index(block, 0, (1, 2, 3, 4))
    second = cache.pool.index(block, 0, (5, 6, 7, 8))  # its content was rewritten
    assert second != first and cache.pool.lookup(0, (1, 2, 3, 4)) is None
    assert cache.pool.lookup(0, (5, 6, 7, 8)) == block and cache.pool.key_of[block] == (0, (5, 6, 7, 8))
    assert cache.pool.index(block, 0, (5, 6, 7, 8)) == second  # the same key again: the same id
    cache.release(0)
    assert list(cache.pool.cached) == [block] and cache.leak() is None


def test_a_fork_into_a_short_pool_refuses_before_changing_anything():
    cache = KVCache(1, 3, 1, 32, 4, block_size=4, num_blocks=4)
    cache.reserve([0], [10])  # two full blocks and a partial one
    cache.lengths[0] = 10
    cache.reserve([1], [4])  # the last free block, held by a target that is about to be given the fork
    tables, refs = cache.tables.clone(), cache.pool.refs.copy()
    with pytest.raises(CacheFull):
        cache.copy_slot(0, [1, 2], 10)  # two partial copies, one block (row 1's own) to make them from
    assert torch.equal(cache.tables, tables) and (cache.pool.refs == refs).all()
    assert cache.lengths.tolist() == [10, 0, 0] and cache.leak() is None
    cache.copy_slot(0, [1], 10)  # one copy: row 1's block comes back and is taken again
    assert cache.tables[1, :2].tolist() == cache.tables[0, :2].tolist() and cache.lengths.tolist() == [10, 10, 0]
    assert cache.pool.available == 0 and cache.leak() is None


@pytest.mark.parametrize("block_size", [4, None])
def test_commit_moves_each_kept_position_to_its_place_in_keys_and_values(block_size):
    """A tree's kept nodes (not a prefix of what was written) end at consecutive positions after the row's length,
    keys and values alike, in either layout; the positions before are untouched."""
    cache = KVCache(2, 2, 1, 16, 2, block_size=block_size, num_blocks=10)
    with torch.inference_mode():
        cache.reserve([0, 1], [9, 9])
        cache.lengths[:] = torch.tensor([3, 2])
        rows, positions = torch.tensor([0, 1]), torch.arange(9)[None].expand(2, 9)
        blocks, offsets = cache.address(rows, positions)
        for layer in range(2):  # position p of row r holds the number 100 r + p (+ 0.5 in values, + layer)
            k = (100 * rows[:, None, None, None] + positions[:, None, :, None] + layer).float().expand(2, 1, 9, 2)
            cache.write(layer, blocks, offsets, k, k + 0.5)
        # row 0 keeps fresh offsets 0, 2, 3 (positions 3, 5, 6); row 1 keeps 0 and 4 (positions 2, 6)
        cache.commit(rows, torch.tensor([[0, 2, 3], [0, 4, 0]]), torch.tensor([3, 2]))
    assert cache.lengths.tolist() == [6, 4]
    for layer in range(2):
        for row, want in ((0, [0, 1, 2, 3, 5, 6]), (1, [0, 1, 2, 6])):
            keys, values = cache.row(layer, row, len(want))  # [1, 2, n], [1, n, 2]
            expected = torch.tensor(want, dtype=torch.float32) + 100 * row + layer
            assert torch.equal(keys[0, 0], expected) and torch.equal(values[0, :, 0], expected + 0.5), (layer, row)
    assert cache.leak() is None


def test_rolling_back_into_an_indexed_block_drops_its_place_in_the_chain():
    """A row cut back inside a block it had indexed, and written differently from there, indexes the new content
    of that block and chains the next ones to it: no later prompt matches the old tokens through the new block."""
    cache = KVCache(1, 2, 1, 32, 4, block_size=4, num_blocks=12)
    old = list(range(1, 13))  # three full blocks
    cache.reserve([0], [12])
    cache.lengths[0] = 12
    cache.index(0, old)
    first_block = int(cache.tables[0, 0])
    assert len(cache.chains[0]) == 3
    cache.rollback(torch.tensor([0]), 6)  # into the second block
    assert len(cache.chains[0]) == 1
    cache.reserve([0], [12])  # the second block is indexed and no one else's: unindexed and written in place
    new = old[:6] + [90, 91, 92, 93, 94, 95]
    cache.lengths[0] = 12
    cache.index(0, new)
    assert len(cache.chains[0]) == 3
    assert cache.match(new + [1], 12) == cache.tables[0, :3].tolist()
    assert cache.match(old + [1], 12) == [first_block]  # the old second block's content is gone
    assert cache.leak() is None


def _resident() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident size from /proc")
def test_a_pools_memory_is_taken_as_blocks_are_written():
    """A pool planned for many positions holds memory only for the blocks written (their pages), not for the whole
    pool at allocation: 256 MiB of keys and values cost next to nothing until written, then what was written."""
    layers, heads, dim = 4, 2, 64
    blocks = 256 * 2**20 // (2 * layers * heads * dim * BLOCK_SIZE * 2)  # 256 MiB of float16 keys and values
    before = _resident()
    cache = KVCache(layers, 4, heads, blocks * BLOCK_SIZE, dim, dtype=torch.float16, block_size=BLOCK_SIZE,
                    num_blocks=blocks)
    allocated = _resident() - before
    assert allocated < 32 * 2**20, allocated
    assert all(not k.any() for k in cache.k) and all(not v.any() for v in cache.v)  # zeros (read: no pages taken)
    for k, v in zip(cache.k, cache.v):
        k[: blocks // 2] = 1
        v[: blocks // 2] = 1
    written = _resident() - before
    assert written > 100 * 2**20, written


def test_freed_blocks_are_handed_out_again_first():
    """The pool hands out its lowest blocks and takes freed ones back first, so the blocks ever written (the
    pool's resident memory) stay as few as the most held at once, however many sequences come and go."""
    pool = BlockPool(64)
    touched = set()
    for round_ in range(50):
        held = [pool.allocate() for _ in range(3 + round_ % 5)]
        touched.update(held)
        for block in held:
            pool.decref(block)
    assert touched == set(range(7))
