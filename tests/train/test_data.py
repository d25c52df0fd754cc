import numpy as np

from specdecode.train import data


def test_reads_only_utf8_nonempty_matching_files(tiny_corpus):
    docs = data.read_documents(tiny_corpus)
    paths = [d.path for d in docs]
    assert paths == sorted(paths)
    assert "sub/latin1.py" not in paths and "sub/empty.py" not in paths and "notes.txt" not in paths
    assert "decoder.py" in paths


def test_heldout_split_is_deterministic_and_order_free():
    docs = [data.Document(f"pkg{i % 7}/mod{i}.py", "x = 1\n") for i in range(2000)]
    train, heldout = data.split_documents(docs, 0.05)
    train2, heldout2 = data.split_documents(list(reversed(docs)), 0.05)
    assert sorted(d.path for d in heldout) == sorted(d.path for d in heldout2)
    assert len(train) + len(heldout) == len(docs) and not {d.path for d in train} & {d.path for d in heldout}
    assert 0.03 < len(heldout) / len(docs) < 0.07
    # A file's side never depends on the other files.
    assert all(data.is_heldout(d.path, 0.05) for d in heldout)


def test_default_corpus_is_the_stdlib():
    root = data.default_corpus_dir()
    assert (root / "json" / "__init__.py").is_file()
    assert not any("site-packages" in p.parts for p in data.list_files(root / "json"))


def test_tokenize_wraps_each_document_and_caches(tiny_corpus, tiny_tokenizer, tmp_path):
    from specdecode.model.tokenizer import Tokenizer

    tok = Tokenizer(tiny_tokenizer)
    docs = data.read_documents(tiny_corpus)
    tokens = data.tokenize_documents(docs, tok, tmp_path / "cache.npy")
    assert tokens.dtype == np.uint16
    assert (tokens == tok.bos_token_id).sum() == len(docs) == (tokens == tok.eos_token_ids[0]).sum()
    assert tokens[0] == tok.bos_token_id and tokens[-1] == tok.eos_token_ids[0]
    assert np.array_equal(data.tokenize_documents(docs[:1], tok, tmp_path / "cache.npy"), tokens)  # cached


def test_batches_depend_on_seed_and_step_only():
    tokens = np.arange(10_000, dtype=np.uint16)
    a = data.sample_windows(tokens, 4, 16, seed=3, step=7)
    assert a.shape == (4, 17) and np.array_equal(a, data.sample_windows(tokens, 4, 16, seed=3, step=7))
    assert not np.array_equal(a, data.sample_windows(tokens, 4, 16, seed=3, step=8))
    assert np.array_equal(a[:, 1:], a[:, :-1] + 1)  # contiguous windows


def test_token_cache_name_changes_with_tokenizer_or_documents(tiny_tokenizer, tmp_path):
    docs = [data.Document("a.py", "x = 1\n"), data.Document("b.py", "y = 2\n")]
    name = data.token_cache_path(tmp_path, tiny_tokenizer, docs)
    assert name == data.token_cache_path(tmp_path, tiny_tokenizer, list(docs))
    assert name != data.token_cache_path(tmp_path, tiny_tokenizer, docs[:1])
    assert name != data.token_cache_path(tmp_path, tiny_tokenizer, [docs[0], data.Document("b.py", "y = 22\n")])
