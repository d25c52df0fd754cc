"""A tiny real corpus for training tests: a few modules of the standard library's json package."""
import shutil

import pytest

from specdecode.train.data import default_corpus_dir


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    src = default_corpus_dir() / "json"
    for path in sorted(src.glob("*.py")):
        shutil.copy(path, root / path.name)
    (root / "sub").mkdir()
    (root / "sub" / "latin1.py").write_bytes("# caf\xe9\n".encode("latin-1"))  # not UTF-8: skipped
    (root / "sub" / "empty.py").write_text("\n")  # empty: skipped
    (root / "notes.txt").write_text("not matched by *.py\n")
    return root


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_corpus, tmp_path_factory):
    from specdecode.train.data import read_documents
    from specdecode.train.tokenizer import save_tokenizer, train_bpe

    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_bpe([d.text for d in read_documents(tiny_corpus)], vocab_size=400), out, 128)
    return out
