"""bench perplexity (specdecode/bench/perplexity.py): the float copy is the kernels' model with dequantised
matrices, and the report's gap is small for a real quantized file and large for a broken one."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from specdecode.bench import perplexity
from specdecode.model.loading import load_model
from specdecode.model.quant import QuantLinear
from specdecode.model.tokenizer import Tokenizer

from .gguf_files import tiny_model, write_gguf

pytestmark = pytest.mark.usefixtures("built_kernels")


@pytest.fixture(scope="module")
def tiny_q4k(tmp_path_factory, tiny_models):
    vocab = Tokenizer(tiny_models["target"]).vocab_size
    return write_gguf(tmp_path_factory.mktemp("ppl") / "tiny-q4k.gguf", tiny_model("qwen2", vocab),
                      tiny_models["tok"] / "tokenizer.json", "qwen2", "Q4_K")


def test_the_float_copy_holds_the_dequantised_matrices(tiny_q4k):
    kept = load_model(tiny_q4k, dtype="float32", quantization="gguf")
    weights = {name: m.weight.clone() for name, m in kept.named_modules() if isinstance(m, QuantLinear)}
    dense = perplexity.dequantised_copy(kept)
    assert not any(isinstance(m, QuantLinear) for m in dense.modules())
    for name, weight in weights.items():
        assert isinstance(dense.get_submodule(name), nn.Linear)
        assert torch.equal(dense.get_submodule(name).weight, weight)
    assert dense.fused_layers(dense.make_cache(1, 8)) is None  # the float path, not the kernels


def test_report_gap(tiny_q4k, monkeypatch):
    report = perplexity.run(tiny_q4k, perplexity.default_text(), windows=2, window=64, log=lambda *_: None)
    assert report["windows"] == 2 and report["kernels"]["tokens"] == 2 * 63
    assert abs(report["relative_gap"]) < 1e-3  # int16 activations: the same model to float rounding
    # a kernel that is wrong (here: logits scaled) shows as a gap
    real = perplexity.window_nll
    monkeypatch.setattr(perplexity, "window_nll", lambda model, ids: real(model, ids) * (
        1.1 if model.fused_layers(model.make_cache(1, 2)) is not None else 1.0))
    assert perplexity.run(tiny_q4k, perplexity.default_text(), 2, 64, log=lambda *_: None)["relative_gap"] > 0.01
