"""The incremental detokenizer streams exactly the text a full decode gives, multi-byte characters included."""
import random

import pytest

from specdecode.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "naïve café, Ünïcödé ✓ — 日本語のテキスト 🚀🐍 done",
    "emoji at the end 👩‍💻",
    "  leading spaces\tand\ttabs\n\n\n",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return Tokenizer(tiny_models["target"])


def stream(tokenizer, prompt_ids, ids, chunk=1) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.add([], final=True)]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_equals_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = tokenizer.encode("x = 1\n")
    deltas = stream(tokenizer, prompt_ids, ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_split_characters_are_held_back(tokenizer):
    """The tiny vocabulary splits '日' into byte tokens: no delta may contain a replacement character."""
    ids = tokenizer.encode("日本", add_special_tokens=False)
    assert len(ids) > 2  # multi-token characters, or this test tests nothing
    deltas = stream(tokenizer, [], ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "日本"


def test_random_token_sequences(tokenizer):
    """Arbitrary ids (as a random model emits: stray bytes, special tokens) still concatenate to the full decode."""
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 30))]
        assert "".join(stream(tokenizer, [0], ids)) == tokenizer.decode(ids)


def test_encode_adds_bos_and_special_ids(tokenizer):
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id == 0
    assert tokenizer.encode("hi", add_special_tokens=False)[0] != 0
    assert tokenizer.eos_token_ids == [1]
    assert tokenizer.decode([0, *tokenizer.encode("hi", add_special_tokens=False), 1]) == "hi"
