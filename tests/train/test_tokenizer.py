import json

import pytest

from specdecode.model.tokenizer import Tokenizer
from specdecode.train.tokenizer import BOS, EOS, PAD

TEXT = "def f(x):\n    return json.dumps({'a': x})  # caf\u00e9\n"


def test_trained_tokenizer_round_trips_and_adds_bos(tiny_tokenizer):
    tok = Tokenizer(tiny_tokenizer)
    assert tok.vocab_size == 400
    assert tok.special_tokens() == {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.decode(ids) == TEXT
    assert tok.encode(TEXT, add_special_tokens=False) == ids[1:]
    gen = json.loads((tiny_tokenizer / "generation_config.json").read_text())
    assert tok.eos_token_ids == [gen["eos_token_id"]] and gen["pad_token_id"] == tok.pad_token_id


def test_transformers_tokenizes_identically(tiny_tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer)
    ours = Tokenizer(tiny_tokenizer)
    assert hf(TEXT)["input_ids"] == ours.encode(TEXT)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (ours.bos_token_id, ours.eos_token_ids[0],
                                                                    ours.pad_token_id)
