"""Bytes read per decode step and the memory-bound ceiling."""
import pytest

from specdecode.bench.roofline import (kv_bytes_per_step, macs_per_token, measure_read_bandwidth, roofline,
                                       weight_bytes_per_step)
from specdecode.model.config import ModelConfig
from specdecode.model.llama import LlamaForCausalLM


def tiny(tied: bool) -> LlamaForCausalLM:
    config = ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_count_one_embedding_row_unless_tied(tied):
    model = tiny(tied)
    all_bytes = 4 * model.config.num_parameters()
    table = 4 * 100 * 16
    expected = all_bytes if tied else all_bytes - table + 4 * 16
    assert weight_bytes_per_step(model) == expected


def test_kv_bytes_and_share():
    model = tiny(False)
    # 2 (k and v) x 2 layers x 2 kv heads x head_dim 4 x 4 bytes x 10 positions
    assert kv_bytes_per_step(model, 10) == 2 * 2 * 2 * 4 * 4 * 10
    r = roofline(model, bandwidth=1e9, context_len=10, tokens_per_s=100.0)
    assert r["ceiling_tokens_per_s"] == pytest.approx(1e9 / (r["weight_bytes"] + r["kv_bytes"]))
    assert r["share"] == pytest.approx(100.0 / r["ceiling_tokens_per_s"])


def test_bandwidth_is_plausible():
    bandwidth = measure_read_bandwidth(bytes_=32 * 2**20, repeats=2)
    assert 1e8 < bandwidth < 1e13  # between 0.1 GB/s and 10 TB/s


def test_multiply_adds_per_token_count_every_product():
    model = tiny(False)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    qkv = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim
    layer = qkv + c.hidden_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    assert macs_per_token(model) == c.num_hidden_layers * layer + c.hidden_size * c.vocab_size


def test_int8_peak_is_plausible():
    from specdecode.model.quant import kernels

    if kernels() is None:
        pytest.skip("the quantized kernels cannot be compiled here")
    peak = kernels().int8_peak_macs(0.05)
    assert 1e9 < peak < 1e13  # one core: above 1 GMAC/s, below 10 TMAC/s
