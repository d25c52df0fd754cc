"""The models shipped in specdecode/catalog load in transformers and give the same logits and tokens."""
import json

import pytest
import torch

from specdecode.model.loading import load_model
from specdecode.model.tokenizer import Tokenizer
from specdecode.catalog import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR, MODELS_DIR

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not (DEFAULT_DRAFT_DIR / "model.safetensors").is_file(),
                                reason="bundled models not trained yet (run `specdecode train all`)")

TEXT = "import os\n\n\ndef read_config(path):\n    with open(path) as f:\n        return f.read()\n"


@pytest.mark.parametrize("model_dir", [DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR], ids=["target", "draft"])
def test_transformers_loads_the_bundled_model_identically(model_dir):
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours_tok = Tokenizer(model_dir)
    ids = ours_tok.encode(TEXT)
    assert hf_tok(TEXT)["input_ids"] == ids
    assert hf_tok.decode(ids, skip_special_tokens=True) == TEXT == ours_tok.decode(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_model(model_dir, dtype="float32", device="cpu")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
        out = ours(torch.tensor([ids])).logits
    assert (out - ref).abs().max() <= 1e-4


def test_bundled_family_fits_the_spec():
    ours_t = load_model(DEFAULT_TARGET_DIR, dtype="float32")
    ours_d = load_model(DEFAULT_DRAFT_DIR, dtype="float32")

    def count(m):
        return sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())

    assert 20e6 <= count(ours_t) <= 40e6 and count(ours_d) <= count(ours_t) / 8
    assert (DEFAULT_TARGET_DIR / "tokenizer.json").read_bytes() == (DEFAULT_DRAFT_DIR / "tokenizer.json").read_bytes()
    for d in (DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR):
        assert json.loads((d / "config.json").read_text())["torch_dtype"] == "bfloat16"
        assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == Tokenizer(d).eos_token_ids[0]
    total = sum(f.stat().st_size for f in MODELS_DIR.rglob("*") if f.is_file())
    assert total <= 100e6
    card = (MODELS_DIR / "MODEL_CARD.md").read_text()
    assert "specdecode train all" in card and "greedy agreement" in card
    assert json.loads((MODELS_DIR / "heldout.json").read_text())["files"]
