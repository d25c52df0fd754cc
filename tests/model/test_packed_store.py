"""The packed matrices of a kept-quantized GGUF are stored on the first load and mapped by the next (packed_store.py):
the same numbers, nothing packed or requantized again, and nothing stale or damaged ever read."""
from __future__ import annotations

import os

import pytest
import torch

from specdecode.model import packed_store, quant
from specdecode.model.loading import load_model
from specdecode.model.quant import QuantLinear

from .test_gguf_formats import IDS, cached_logits, written  # noqa: F401 (the fixture)

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("built_kernels")


@pytest.fixture
def store_here(tmp_path, monkeypatch):
    """Stores for any GGUF (the tiny ones too) in a cache of the test's own; a fresh store per load."""
    monkeypatch.setattr(packed_store, "SMALLEST", 0)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    packed_store.store_for.cache_clear()
    yield tmp_path / "cache" / "packed"
    packed_store.store_for.cache_clear()


def load(path):
    packed_store.store_for.cache_clear()
    return load_model(path, quantization="gguf")


def count_packing(monkeypatch) -> list[int]:
    """Counts every matrix packed from now on."""
    calls = []
    module = quant.require_kernels()

    class Counting:
        def __getattr__(self, name):
            return getattr(module, name)

        def pack(self, *args):
            calls.append(1)
            return module.pack(*args)

    monkeypatch.setattr(quant, "require_kernels", lambda: Counting())
    return calls


def mapped_from_store(model) -> bool:
    """Whether every packed matrix of the model is a view of a stored file's map (one buffer for the whole file),
    not memory this process packed into."""
    return all(tensor.untyped_storage().nbytes() > tensor.numel()
               for module in model.modules() if isinstance(module, QuantLinear) for tensor in module.packed)


def test_a_second_load_maps_what_the_first_packed(written, store_here, monkeypatch):
    path = written("Q4_K", mixed=True)
    first = load(path)
    expected = cached_logits(first, IDS)
    files = list(store_here.glob("*.safetensors"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    assert not mapped_from_store(first)  # packed here, then written
    calls = count_packing(monkeypatch)
    again = load_model(path, quantization="gguf")  # the same process's store, after it wrote the file: mapped
    assert calls == [] and mapped_from_store(again)
    second = load(path)
    assert calls == [] and mapped_from_store(second)
    assert torch.equal(cached_logits(second, IDS), expected)


def test_a_changed_gguf_or_a_damaged_store_is_packed_again(written, store_here, monkeypatch, capsys):
    path = written("Q8_0")
    expected = cached_logits(load(path), IDS)
    stored = next(store_here.glob("*.safetensors"))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # touched: packed again
    calls = count_packing(monkeypatch)
    assert torch.equal(cached_logits(load(path), IDS), expected)
    assert calls and "changed since they were packed" in capsys.readouterr().err
    calls.clear()
    assert torch.equal(cached_logits(load(path), IDS), expected) and calls == []  # (rewritten: mapped now)
    with open(stored, "r+b") as f:  # cut short, as a full disk would leave it (were it not renamed into place)
        f.truncate(stored.stat().st_size // 2)
    assert torch.equal(cached_logits(load(path), IDS), expected)
    assert calls and "packing again" in capsys.readouterr().err


def test_a_drafts_requantized_rows_are_stored_too(written, store_here, monkeypatch):
    """lighten's Q4_0 rows and their packed matrices come from the store at the next start: nothing is dequantized
    or requantized again, and the lightened model computes the same numbers."""
    path = written("Q8_0")

    def lightened():
        model = load_model(path, quantization="gguf", keep=False)
        store = packed_store.store_for(path)
        quant.lighten(model, "q4_0", store)
        packed_store.keep_packed(model, store)
        return model

    packed_store.store_for.cache_clear()
    expected = cached_logits(lightened(), IDS)
    packed_store.store_for.cache_clear()

    def refuse(*args, **kwargs):
        raise AssertionError("requantized again")

    monkeypatch.setattr(quant, "quantize", refuse)
    calls = count_packing(monkeypatch)
    model = lightened()
    assert calls == [] and "q8_0" not in {m.fmt for m in model.modules() if isinstance(m, QuantLinear)}
    assert torch.equal(cached_logits(model, IDS), expected)


def test_a_draft_with_the_same_gguf_tokenizer_skips_the_token_comparison(written, tiny_models, tmp_path):
    """same_gguf_tokenizer: two GGUFs whose tokenizer fields are all equal (a target and its draft) need no
    token-by-token comparison; one changed token, or a checkpoint that is not a GGUF, takes the full check."""
    from specdecode.model.gguf import same_gguf_tokenizer

    a, b = written("Q8_0"), written("Q4_0")
    assert same_gguf_tokenizer(a, b)
    assert not same_gguf_tokenizer(a, tiny_models["target"]) and not same_gguf_tokenizer(a, None)
    data = bytearray(b.read_bytes())
    token = b"def"  # a token of the tiny vocabulary, renamed in place (same length: the file stays valid)
    at = data.find(token, 0, 1 << 20)
    assert at > 0
    data[at:at + 3] = b"deg"
    changed = tmp_path / "changed.gguf"
    changed.write_bytes(bytes(data))
    assert not same_gguf_tokenizer(a, changed)
