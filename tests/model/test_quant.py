"""Block-quantized weights (model/quant.py, kernels/quant.cpp): the kernels against a reference written here,
bitwise batch invariance, GGUF bytes kept as shipped, and the model-level behaviour (state dict, digest, errors)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from specdecode.errors import ConfigError
from specdecode.model.digest import weights_digest
from specdecode.model.loading import load_model
from specdecode.model.quant import (BLOCKS, FORMATS, QUANTIZE_FORMATS, QuantEmbedding, QuantLinear, dequantize,
                                    kernels, lighten, quantize, quantized_format, row_bytes)

from .gguf_files import kernel_rounded, random_blocks, tiny_model, write_gguf

pytestmark = pytest.mark.usefixtures("built_kernels")

ROW_LENGTHS = {32: [1, 2, 7, 8, 9, 16, 18, 28], 256: [1, 2, 3, 6]}
"""Row lengths tested, in blocks: whole groups of 8 blocks of 32, a partial group, both (28 blocks: the 0.5B's 896
inputs); a K-quant row is whole super-blocks of 256."""

ACTIVATION_ROWS = (1, 5, 11, 17, 33)
"""Activation rows of the equality test: one, part of a tile, and two or more tiles with a remainder (tiles are 4, 8
or 16 rows, split evenly: 17 rows run as 9 + 8), so the second tile's indexing is checked against the reference too."""


def gguf_reference(q: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """gguf's (llama.cpp's Python reader's) dequantization of q [rows, bytes] -> float64 [rows, in_features]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(q.numpy(), GGMLQuantizationType[fmt.upper()])
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(q.shape[0], in_features).double()


def weights(fmt: str, rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Random valid blocks of fmt (random quants and sub-scales, small float16 scales) [rows, bytes]."""
    return torch.from_numpy(random_blocks(fmt, rows, in_features, np.random.default_rng(seed)))


@pytest.fixture(params=[32, 256], ids=["act32", "act256"])
def k_block(request):
    """Runs a test with the K-quants' activations rounded per 32 values (the default) and per 256 (llama.cpp's Q8_K)."""
    kernels().set_k_activation_block(request.param)
    yield request.param
    kernels().set_k_activation_block(32)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("simd", [True, False])
def test_matmul_equals_the_gguf_reference(fmt, simd, k_block):
    """Every format, every row length tested, every count of activation rows in ACTIVATION_ROWS: the product equals
    the int8-rounded activations times gguf's dequantised weights to float32 rounding (3e-5 of the largest output),
    and the lookup of rows equals gguf's dequantization bit for bit."""
    values = BLOCKS[fmt][0]
    for blocks in ROW_LENGTHS[values]:
        K = blocks * values
        q = weights(fmt, 37, K, seed=blocks)
        assert q.shape == (37, row_bytes(fmt, K)) and q.dtype == torch.uint8
        reference = gguf_reference(q, fmt, K)
        assert torch.equal(kernels().dequantize_rows(q, FORMATS[fmt], K, torch.arange(37)), reference.float())
        torch.manual_seed(blocks)
        x = torch.randn(max(ACTIVATION_ROWS), K)
        expected = kernel_rounded(x, k_block if values == 256 else 32) @ reference.T  # [33, 37]
        for m in ACTIVATION_ROWS:
            out = kernels().qmatmul(x[:m], q, FORMATS[fmt], simd)
            assert out.dtype == torch.float32 and out.shape == (m, 37)
            # float32 sums of up to 1,536 products: the worst over 30 random inputs per format was 1.1e-5 of the
            # largest output; one wrong block moves it by ~1e-2
            atol = 3e-5 * expected[:m].abs().max().item()
            torch.testing.assert_close(out.double(), expected[:m], rtol=0, atol=atol, msg=lambda e: f"{m} rows: {e}")


@pytest.mark.parametrize("fmt", sorted(QUANTIZE_FORMATS))
def test_quantize_decodes_as_meant(fmt):
    """quantize() writes gguf's layout: the product is close to the float one (a 4-bit step of a Gaussian's range
    is ~0.4 sigma, error ~0.12 sigma; an 8-bit one ~0.05 sigma)."""
    torch.manual_seed(0)
    weight, x = torch.randn(37, 96) * 0.1, torch.randn(11, 96)
    out, exact = kernels().qmatmul(x, quantize(weight, fmt), FORMATS[fmt], True), x @ weight.T
    assert (out - exact).norm() / exact.norm() < {"q8_0": 0.02, "q5_0": 0.1, "q5_1": 0.1}.get(fmt, 0.2)
    assert torch.equal(dequantize(quantize(weight, fmt), fmt, 96).double(),
                       gguf_reference(quantize(weight, fmt), fmt, 96))


def vector_widths() -> list[int]:
    """The vector widths this build's products can use (a 512-bit build also runs its 256-bit kernels)."""
    return [512, 256] if kernels().vector_bits() == 512 else [kernels().vector_bits()]


@pytest.fixture(params=[512, 256], ids=["512-bit", "256-bit"])
def width(request):
    """Runs a test with the products on vectors of each width this build has (the other is skipped)."""
    if request.param not in vector_widths():
        pytest.skip(f"this build has no {request.param}-bit products")
    saved = kernels().vector_bits()
    kernels().set_vector_bits(request.param)
    yield request.param
    kernels().set_vector_bits(saved)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_rows_result_does_not_depend_on_the_other_rows(fmt, width, k_block):
    """Bitwise: row i of a product over M rows equals the product of row i alone, for every M from 1 to 40 (tiles
    of 1 to 16 rows and every remainder), with one or two threads splitting the outputs, among rows of other sizes;
    and it equals the scalar reference bit for bit (the float steps are the same fixed ones on every path), with
    vectors of every width the build has."""
    torch.manual_seed(1)
    K = 19 * 32 if BLOCKS[fmt][0] == 32 else 3 * 256  # (32-blocks: two whole groups of 8 blocks and a partial one)
    q = weights(fmt, 301, K, seed=1)  # (301 rows: 18 whole groups of 16 and 13 rows of a last one)
    x = torch.randn(40, K)
    alone = torch.cat([kernels().qmatmul(x[i:i + 1], q, FORMATS[fmt], True) for i in range(40)])
    assert torch.equal(alone, kernels().qmatmul(x, q, FORMATS[fmt], False))
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for m in range(1, 41):
                assert torch.equal(kernels().qmatmul(x[:m], q, FORMATS[fmt], True), alone[:m]), (n_threads, m)
            for m in (5, 8, 9, 33):  # row 0 among rows a hundred times larger
                batch = torch.cat([x[:1], torch.randn(m - 1, K) * 100])
                assert torch.equal(kernels().qmatmul(batch, q, FORMATS[fmt], True)[0], alone[0]), (n_threads, m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_row_length(fmt, width, k_block):
    """Rows of whole groups, a partial group, or both: the kernels equal the scalar reference bitwise."""
    values = BLOCKS[fmt][0]
    for blocks in ROW_LENGTHS[values]:
        q = weights(fmt, 45, blocks * values, seed=blocks)
        x = torch.randn(11, blocks * values)
        assert torch.equal(kernels().qmatmul(x, q, FORMATS[fmt], True), kernels().qmatmul(x, q, FORMATS[fmt], False))


def test_a_stack_of_parts_in_different_formats():
    """A stacked matrix whose parts differ in format (a Q4_K_M file's q/k in Q4_K, v in Q6_K) is the parts'
    products side by side, bit for bit, whichever activation orders the parts need."""
    parts = [("q4_k", weights("q4_k", 24, 512, 1)), ("q6_k", weights("q6_k", 8, 512, 2)),
             ("q4_1", weights("q4_1", 5, 512, 3)), ("q8_0", weights("q8_0", 3, 512, 4))]
    x = torch.randn(6, 512)
    packed = [kernels().pack(q, FORMATS[f], 512) for f, q in parts]
    stacked = kernels().qmatmul_parts(x, packed, [FORMATS[f] for f, _ in parts], True)
    assert torch.equal(stacked, torch.cat([kernels().qmatmul(x, q, FORMATS[f], True) for f, q in parts], dim=1))
    layer = QuantLinear(parts, 512, 40)
    assert layer.fmt == "q4_k+q6_k+q4_1+q8_0" and layer.bytes_read() == sum(p.numel() for p in packed)
    with torch.inference_mode():
        assert torch.equal(layer(x), stacked)
    torch.testing.assert_close(layer.weight.double(), torch.cat([gguf_reference(q, f, 512) for f, q in parts]))
    with pytest.raises(ConfigError, match="hold 40 rows"):
        QuantLinear(parts, 512, 41)
    with pytest.raises(ConfigError, match="rows of 288 bytes"):
        QuantLinear(("q4_k", weights("q4_k", 2, 256, 0)), 512, 2)


def test_lighten_requantizes_only_the_heavier_parts():
    """A draft's matrices in more than 4.5 bits per weight become Q4_0 (the rest stay as they are), a module at a
    time, with the same weights to Q4_0's precision."""
    parts = [("q4_k", weights("q4_k", 8, 512, 1)), ("q8_0", weights("q8_0", 8, 512, 2))]
    model = nn.Sequential(QuantLinear(parts, 512, 16), QuantLinear(("q4_0", weights("q4_0", 4, 512, 3)), 512, 4))
    before = [m.weight.clone() for m in model]
    kept = model[1]
    lighten(model)
    assert model[0].formats == ["q4_k", "q4_0"] and model[1] is kept
    assert torch.equal(model[0].qweights[0], parts[0][1])
    assert model[0].bytes_read() < sum(kernels().pack(q, FORMATS[f], 512).numel() for f, q in parts)
    scale = before[0][8:].abs().amax(dim=1, keepdim=True)  # Q4_0 steps by 1/8 of a block's largest value
    assert ((model[0].weight[8:] - before[0][8:]).abs() <= scale / 8 + 1e-6).all()
    assert torch.equal(model[0].weight[:8], before[0][:8])


def test_bad_weights_are_refused():
    q = quantize(torch.randn(4, 64), "q8_0")
    with pytest.raises(RuntimeError, match="hold 68 bytes; format 2 with 64 inputs needs 40"):
        kernels().qmatmul(torch.randn(1, 64), q, FORMATS["q4_1"], True)
    with pytest.raises(ConfigError, match="blocks are 32 wide"):
        quantize(torch.randn(4, 40), "q8_0")
    with pytest.raises(RuntimeError, match="out of range"):
        kernels().dequantize_rows(q, FORMATS["q8_0"], 64, torch.tensor([4]))


def test_linear_and_embedding_modules():
    torch.manual_seed(2)
    linear = nn.Linear(64, 10)
    layer = QuantLinear.from_linear(linear, "q8_0")
    x = torch.randn(2, 3, 64)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (2, 3, 10)
    assert (out - linear(x)).norm() < 0.02 * linear(x).norm()
    state = layer.state_dict()
    assert set(state) == {"weight", "bias"} and torch.equal(state["weight"], layer.weight)
    table = torch.randn(20, 64)
    embedding = QuantEmbedding(quantize(table, "q4_1"), "q4_1", 20, 64)
    ids = torch.tensor([[3, 19], [0, 3]])
    assert torch.equal(embedding(ids), embedding.weight[ids])
    assert (embedding(ids) - table[ids]).abs().max() < 0.3


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_models):
    folder = tmp_path_factory.mktemp("quant-gguf")
    model = tiny_model("llama", vocab_size=300)
    return write_gguf(folder / "q41.gguf", model, tiny_models["tok"] / "tokenizer.json", "llama", "Q4_1"), model


def test_gguf_matrices_kept_as_shipped(tiny_gguf):
    """quantization='gguf' multiplies the file's own Q4_1 bytes: the same numbers as the dequantised model up to
    the activations' rounding, the same state dict and digest, and no float copy of the matrices."""
    path, _ = tiny_gguf
    kept = load_model(path, dtype="float32", quantization="gguf")
    dense = load_model(path, dtype="float32")
    assert quantized_format(kept) == "q4_1" and quantized_format(dense) is None
    assert not any(isinstance(m, nn.Linear) for m in kept.modules())
    assert sum(p.numel() for p in kept.parameters()) < 0.02 * sum(p.numel() for p in dense.parameters())
    state, dense_state = kept.state_dict(), dense.state_dict()
    assert state.keys() == dense_state.keys()
    assert all(torch.equal(state[k], dense_state[k]) for k in state)
    assert weights_digest(kept) == weights_digest(dense)
    ids = torch.randint(0, 300, (2, 9))
    with torch.inference_mode():
        a, b = kept(ids).logits, dense(ids).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    again = load_model(path, dtype="float32", quantization="gguf")  # the same file, mapped again
    with torch.inference_mode():
        assert torch.equal(again(ids).logits, a)


def test_quantized_at_load(tiny_models):
    dense = load_model(tiny_models["target"], dtype="float32")
    q8 = load_model(tiny_models["target"], dtype="float32", quantization="q8_0")
    assert quantized_format(q8) == "q8_0"
    ids = torch.randint(0, 300, (1, 12))
    with torch.inference_mode():
        a, b = q8(ids).logits, dense(ids).logits
    # each matrix is within ~1% (test_linear_and_embedding_modules); a random model amplifies that over layers
    assert (a - b).norm() < 0.15 * b.norm()


def test_quantization_errors(tiny_models):
    with pytest.raises(ConfigError, match="is not a GGUF; use q8_0"):
        load_model(tiny_models["target"], quantization="gguf")
    with pytest.raises(ConfigError, match="not supported; use one of"):
        load_model(tiny_models["target"], quantization="q3_x")


def test_without_the_kernels_auto_falls_back_to_float_weights(tiny_gguf, monkeypatch, capsys):
    """Where the kernels cannot be built, 'auto' says so in one line and loads float weights; asking for a kept
    quantization explicitly is refused in one line that names what to install or pass."""
    from specdecode import kernels as compiled
    from specdecode.model import quant
    from specdecode.model.loading import resolve_quantization

    path, _ = tiny_gguf
    monkeypatch.setattr(quant, "kernels", lambda: None)
    monkeypatch.setattr(compiled, "failure", lambda: "RuntimeError: Ninja is required to load C++ extensions")
    assert resolve_quantization("auto", path, torch.device("cpu")) is None
    assert "could not be built (RuntimeError: Ninja is required" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="install a C\\+\\+ compiler .* or load the model without quantization"):
        load_model(path, dtype="float32", quantization="gguf")


def test_q4_0_quantizer_writes_gguf_bytes():
    """The kernels' Q4_0 quantizer (a draft's requantization at load) writes gguf's bytes exactly: random rows, a
    zero block, a block whose largest magnitude is negative, ties between magnitudes, values at the rounding edges."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    torch.manual_seed(0)
    weight = torch.randn(37, 96) * torch.logspace(-3, 1, 37)[:, None]
    weight[0, :32] = 0  # d = 0
    weight[1, :32] = torch.linspace(-4, 3, 32)  # the largest magnitude is negative
    weight[2, :32] = torch.tensor([1.0, -1.0] * 16)  # ties: the first one sets the sign
    weight[3, :32] = torch.arange(32) / 31 * 8 - 8  # multiples of the step: x / d + 8.5 lands on .5 edges
    expected = gguf_quantize(weight.numpy(), GGMLQuantizationType.Q4_0)
    assert torch.equal(kernels().quantize_q4_0(weight), torch.from_numpy(np.ascontiguousarray(expected)))
    assert torch.equal(quantize(weight, "q4_0"), kernels().quantize_q4_0(weight))
