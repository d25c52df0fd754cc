"""The 8-bit KV cache (kv_cache_dtype q8_0, kernels/quant.h's Q8_GROUP layout): the kernels write each group of 32
values of a new key or value as llama.cpp's q8_0 rounds it (a float16 scale stored beside the group), read the cache as
the very numbers a float32 cache of the dequantized entries holds (so every SIMD path gives the scalar bits, and a
token's bits do not depend on how the forward is cut), and the engine stays token for token plain decoding."""
from __future__ import annotations

import pytest
import torch

from specdecode.errors import ConfigError
from specdecode.model.cache import KVCache, stored_rows
from specdecode.model.quant import kernels, quantize_linears

from tests.model.test_attention_kernel import make_cache, on_every_width, random_tree
from tests.model.test_linear import tiny_model

pytestmark = pytest.mark.skipif(kernels() is None, reason="the kernels cannot be compiled here")


def q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q8_0 of x [..., n * 32] by groups of its last 32 values, as the kernels compute it: (values int8 [..., n * 32],
    scales float16 [..., n], dequantized float32 [..., n * 32])."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    d = groups.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(groups * inverse[..., None]).clamp(-127, 127).to(torch.int8)
    scale = d.half()
    return q.reshape(x.shape), scale, (scale.float()[..., None] * q.float()).reshape(x.shape)


def scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """float16 scales [..., n] -> their bytes [..., 2 n], low byte first (as int8)."""
    return scale.view(torch.int16).unsqueeze(-1).view(torch.uint8).flatten(-2).view(torch.int8)


def packed(keys: torch.Tensor, values: torch.Tensor):
    """float keys [blocks, G, hd, bs] and values [blocks, G, bs, hd] -> (the 8-bit cache of them, keys [blocks, G,
    hd + hd / 16, bs] and values [blocks, G, bs, hd + hd / 16]; and the float32 cache of the numbers it holds)."""
    kq, ks, kd = q8(keys.transpose(2, 3))  # groups of a position's key: along hd
    vq, vs, vd = q8(values)
    k8 = torch.cat([kq, scale_bytes(ks)], -1).transpose(2, 3).contiguous()
    v8 = torch.cat([vq, scale_bytes(vs)], -1).contiguous()
    return k8, v8, kd.transpose(2, 3).contiguous(), vd.contiguous()


@pytest.mark.parametrize("block_size, hd", [(16, 32), (5, 64), (64, 32)])
def test_the_kernel_reads_the_8bit_cache_as_its_dequantized_numbers(block_size, hd):
    g = torch.Generator().manual_seed(7)
    H, G = 6, 2
    for B, T, pending, tree in [(1, 1, 0, False), (2, 5, 0, True), (3, 17, 2, False), (1, 40, 0, False),
                                (2, 9, 3, True)]:
        lengths = torch.randint(0, 70, (B,), generator=g)
        keys, values, tables = make_cache(B, int(lengths.max()) + pending + T, G, torch.float32, block_size, hd=hd)
        k8, v8, k32, v32 = packed(keys, values)
        assert k8.shape[2] == v8.shape[3] == stored_rows(hd, torch.int8)
        visible = torch.stack([random_tree(T, pending, g) for _ in range(B)]) if tree else None
        q = torch.randn(B * T, H * hd, generator=g)
        want = kernels().attention(q, k32, v32, tables, lengths, pending, visible, H, G, T, use_simd=False)
        got = on_every_width(lambda simd: kernels().attention(q, k8, v8, tables, lengths, pending, visible, H, G, T,
                                                              use_simd=simd))
        assert torch.equal(got, want), (B, T, pending, tree)


def model():
    m = tiny_model(hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)  # (head size 32: one group)
    quantize_linears(m, "q8_0")
    return m


def test_the_kernels_write_keys_and_values_as_q8_0_rounds_them():
    """The first layer's keys and values (which depend on the tokens alone) written into an 8-bit cache are the
    reference quantization of those a float32 cache holds, byte for byte, scales included."""
    m = model()
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(8))
    caches = {dtype: m.make_cache(1, 48, block_size=16, num_blocks=4, dtype=dtype) for dtype in (torch.float32,
                                                                                                 torch.int8)}
    with torch.inference_mode():
        for cache in caches.values():
            m(ids, cache=cache)
    blocks = caches[torch.float32].tables[0, :3]
    k8, v8, _, _ = packed(caches[torch.float32].k[0][blocks], caches[torch.float32].v[0][blocks])
    written = slice(0, 40 - 32)  # the third block's written positions
    got_k, got_v = caches[torch.int8].k[0][blocks], caches[torch.int8].v[0][blocks]
    assert torch.equal(got_k[:2], k8[:2]) and torch.equal(got_v[:2], v8[:2])
    assert torch.equal(got_k[2, ..., written], k8[2, ..., written])
    assert torch.equal(got_v[2, :, written], v8[2, :, written])


def test_a_prompts_8bit_cache_and_logits_are_the_same_bits_however_it_is_prefilled():
    m = model()
    ids = torch.randint(3, 90, (1, 70), generator=torch.Generator().manual_seed(4))

    def prefill(chunk: int, beside: bool = False):
        cache = m.make_cache(2, 80, block_size=16, num_blocks=12, dtype=torch.int8)
        logits = []
        with torch.inference_mode():
            for start in range(0, ids.shape[1], chunk):
                part = ids[:, start:start + chunk]
                if beside:
                    part = torch.cat([part, torch.randint(3, 90, part.shape)])
                out = m(part, cache=cache, slots=torch.tensor([0, 1][:part.shape[0]])).logits
                logits.append(out[:1])
                cache.advance(torch.tensor([0, 1][:part.shape[0]]), part.shape[1])
        keys = torch.stack([cache.k[layer][cache.tables[0, :5]] for layer in range(len(cache.k))])
        return torch.cat(logits, 1), keys

    whole, whole_keys = prefill(70)
    assert whole_keys.dtype == torch.int8
    for chunk, beside in ((1, False), (5, False), (16, False), (16, True)):
        logits, keys = prefill(chunk, beside)
        assert torch.equal(logits, whole), (chunk, beside)
        assert torch.equal(keys, whole_keys), (chunk, beside)
    # rounded, not wrong: as far from a float32 cache's logits as about twice a float16 cache's rounding (this
    # random tiny model magnifies both: float16 alone moves its logits by 3% of their mean)
    with torch.inference_mode():
        exact, half = (m(ids, cache=m.make_cache(1, 80, block_size=16, dtype=dtype)).logits
                       for dtype in (torch.float32, torch.float16))
    assert (whole - exact).abs().mean() < 3 * (half - exact).abs().mean()


def test_the_8bit_cache_is_refused_where_the_kernels_do_not_read_it(tiny_models):
    from specdecode.engine.llm import LLM

    with pytest.raises(ConfigError, match="q8_0"):
        LLM(tiny_models["target"], dtype="float32", quantization="none", kv_cache_dtype="q8_0")
    cache = KVCache(1, 1, 2, 32, 32, dtype=torch.int8, block_size=16)
    with pytest.raises(ConfigError, match="fused CPU kernels only"):
        cache.read(0, torch.tensor([[0, 1]]), 20)
    with pytest.raises(ConfigError, match="multiple of 32"):
        KVCache(1, 1, 2, 32, 40, dtype=torch.int8, block_size=16)


def test_greedy_speculation_stays_plain_decoding_over_the_8bit_cache(tiny_models, tmp_path):
    from specdecode.engine.llm import LLM
    from specdecode.sampling import SamplingParams

    from tests.conftest import make_checkpoint
    from tests.engine.test_paged import QUESTIONS, SYSTEM

    target = tmp_path / "target"
    make_checkpoint(target, tiny_models["tok"], seed=0, layers=2, hidden=128)  # (head size 32)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [SYSTEM + q for q in QUESTIONS[:4]]
    plain = LLM(target, dtype="float32", quantization="q4_1", kv_cache_dtype="q8_0",
                speculative_config=None, max_num_seqs=4)
    assert plain.runner.cache is None or plain.runner.kv_dtype == torch.int8
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert plain.runner.cache.k[0].dtype == torch.int8
    spec = LLM(target, dtype="float32", quantization="q4_1", kv_cache_dtype="q8_0",
               speculative_config={"method": "draft_model", "model": str(target), "num_speculative_tokens": 3,
                                   "adaptive": False}, max_num_seqs=4)  # (drafting in Q8_0: mostly accepted)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    assert 0 < spec.total_stats.accepted_tokens < spec.total_stats.draft_tokens  # (rejected drafts rolled back)
