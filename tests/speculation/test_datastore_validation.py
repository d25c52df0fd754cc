"""REST datastores are checked when opened: a datastore built by `specdecode datastore build`, then damaged in one
way at a time (ids outside the vocabulary, a suffix array out of range, repeated, out of order, too short, of the
wrong dtype or shape, datastore.json disagreeing), is refused with a one-line CheckpointError naming the file; the
undamaged one loads and answers lookups; the order check agrees with brute force. (The command line's refusal:
tests/speculation/test_rest.py.)"""
import json
import random
import shutil

import numpy as np
import pytest

import specdecode.speculation.datastore as datastore_module
from specdecode.cli import main
from specdecode.errors import CheckpointError
from specdecode.model.tokenizer import Tokenizer
from specdecode.speculation.datastore import Datastore, open_datastore, unsorted_rank

ANSWERS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
]


@pytest.fixture(scope="module")
def built(tiny_models, tmp_path_factory):
    """A datastore of a few answers, written by the command line with the tiny target's tokenizer."""
    root = tmp_path_factory.mktemp("validation")
    data = root / "answers.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "?"},
                                                      {"role": "assistant", "content": a}]}) + "\n"
                            for a in ANSWERS))
    assert main(["datastore", "build", "--model", str(tiny_models["target"]), "--data", str(data),
                 "--out", str(root / "ds")]) == 0
    return root / "ds"


@pytest.fixture
def tokenizer(tiny_models):
    return Tokenizer(tiny_models["target"])


def test_built_datastore_records_its_vocabulary_and_loads(built, tokenizer):
    store = open_datastore(built, tokenizer, None)
    assert store.info.vocab_size == tokenizer.vocab_size
    context = tokenizer.encode("def add(a, b):", add_special_tokens=False)
    assert any(tokenizer.decode(list(c)).startswith("\n") for c in store.continuations(context, 3))


def test_datastore_without_a_recorded_vocabulary_still_loads(built, tokenizer, tmp_path):
    """datastore.json written before vocab_size was recorded."""
    folder = shutil.copytree(built, tmp_path / "ds")
    rewrite_json(folder, without_vocab_size)
    assert open_datastore(folder, tokenizer, None).info.vocab_size is None


def rewrite(folder, name, edit):
    np.save(folder / name, edit(np.load(folder / name)))


def rewrite_json(folder, edit):
    path = folder / "datastore.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def with_value(array, index, value, dtype=None):
    array = array.astype(dtype or array.dtype)
    array[index] = value
    return array


def without_vocab_size(info):
    return {k: v for k, v in info.items() if k != "vocab_size"}


def swap_adjacent(folder, _vocab):
    """Swap a pair of suffixes that differ at their first token, so the order check sees it however far it looks."""
    tokens, sa = np.load(folder / "tokens.npy"), np.load(folder / "suffix_array.npy")
    rank = next(i for i in range(len(sa) - 1) if tokens[sa[i]] != tokens[sa[i + 1]])
    sa[[rank, rank + 1]] = sa[[rank + 1, rank]]
    np.save(folder / "suffix_array.npy", sa)


DAMAGES = {  # name: (damage(folder, vocab_size), the file the refusal names, what it says)
    "id_at_vocab": (lambda f, vocab: rewrite(f, "tokens.npy", lambda t: with_value(t, 5, vocab)),
                    "tokens.npy", "outside the vocabulary"),
    "id_at_vocab_unrecorded": (lambda f, vocab: (rewrite_json(f, without_vocab_size),
                                                 rewrite(f, "tokens.npy", lambda t: with_value(t, 5, vocab))),
                               "tokens.npy", "outside the vocabulary"),
    "negative_id": (lambda f, _: rewrite(f, "tokens.npy", lambda t: with_value(t, 5, -1, np.int32)),
                    "tokens.npy", "token id -1"),
    "float_tokens": (lambda f, _: rewrite(f, "tokens.npy", lambda t: t.astype(np.float32)),
                     "tokens.npy", "not a 1-D array of integers"),
    "2d_tokens": (lambda f, _: rewrite(f, "tokens.npy", lambda t: t[None]), "tokens.npy", "not a 1-D array"),
    "short_tokens": (lambda f, _: rewrite(f, "tokens.npy", lambda t: t[:-1]), "tokens.npy", "datastore.json records"),
    "sa_past_end": (lambda f, _: rewrite(f, "suffix_array.npy", lambda sa: with_value(sa, 3, len(sa))),
                    "suffix_array.npy", "outside the corpus"),
    "sa_negative": (lambda f, _: rewrite(f, "suffix_array.npy", lambda sa: with_value(sa, 3, -1)),
                    "suffix_array.npy", "outside the corpus"),
    "sa_repeated": (lambda f, _: rewrite(f, "suffix_array.npy", lambda sa: with_value(sa, 3, sa[4])),
                    "suffix_array.npy", "not a permutation"),
    "sa_swapped": (swap_adjacent, "suffix_array.npy", "not in suffix order"),
    "sa_short": (lambda f, _: rewrite(f, "suffix_array.npy", lambda sa: sa[:-1]), "suffix_array.npy", "entries for"),
    "sa_float": (lambda f, _: rewrite(f, "suffix_array.npy", lambda sa: sa.astype(np.float64)),
                 "suffix_array.npy", "not a 1-D array"),
    "json_num_tokens": (lambda f, _: rewrite_json(f, lambda i: {**i, "num_tokens": i["num_tokens"] + 1}),
                        "tokens.npy", "datastore.json records"),
    "json_vocab_size": (lambda f, _: rewrite_json(f, lambda i: {**i, "vocab_size": i["vocab_size"] + 1}),
                        "datastore.json", "records a vocabulary of"),
    "json_separator": (lambda f, _: rewrite_json(f, lambda i: {**i, "separator": "eos"}),
                       "datastore.json", "not an integer"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_datastores_are_refused_in_one_line(built, tokenizer, tmp_path, damage):
    folder = shutil.copytree(built, tmp_path / "ds")
    change, file, what = DAMAGES[damage]
    change(folder, tokenizer.vocab_size)
    with pytest.raises(CheckpointError) as info:
        open_datastore(folder, tokenizer, None)
    message = str(info.value)
    assert str(folder / file) in message and what in message, message
    assert "specdecode datastore build" in message and "\n" not in message


def test_the_order_check_samples_a_large_datastore(built, tmp_path, monkeypatch):
    """With fewer sampled pairs than the datastore has, a reversed suffix array (every pair wrong, still a
    permutation) is caught and the right one passes."""
    monkeypatch.setattr(datastore_module, "ORDER_SAMPLE", 8)
    assert len(Datastore(built).tokens) > 100
    folder = shutil.copytree(built, tmp_path / "ds")
    rewrite(folder, "suffix_array.npy", lambda sa: sa[::-1])
    with pytest.raises(CheckpointError, match="not in suffix order"):
        Datastore(folder)


def first_unsorted_rank(corpus, sa):
    return next((i for i in range(len(sa) - 1) if not corpus[sa[i]:] < corpus[sa[i + 1]:]), None)


def test_order_check_matches_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        corpus = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
        sa = sorted(range(len(corpus)), key=lambda i: corpus[i:])
        if rng.random() < 0.7 and len(sa) > 1:  # damage it: swap two entries or repeat one
            i, j = rng.sample(range(len(sa)), 2)
            sa[i], sa[j] = (sa[j], sa[i]) if rng.random() < 0.5 else (sa[j], sa[j])
        got = unsorted_rank(np.array(corpus, dtype=np.uint16), np.array(sa, dtype=np.int32), window=len(corpus))
        assert got == first_unsorted_rank(corpus, sa), (corpus, sa)
