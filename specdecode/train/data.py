"""Training corpus: a folder of text files, split by file into train and held-out sets, tokenized once.

The default corpus is the Python standard library of the running interpreter. The split hashes each file's
path relative to the corpus root, so it does not depend on file order, the machine or the random seed.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdecode.errors import ConfigError

MAX_FILE_BYTES = 2_000_000
"""Larger files (generated tables, data dumps) are skipped: they would dominate a small corpus."""


def default_corpus_dir() -> Path:
    """The standard library source folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass
class Document:
    path: str
    """Path relative to the corpus root, with forward slashes."""
    text: str


def list_files(root: Path, pattern: str = "*.py") -> list[Path]:
    """Every file matching pattern under root, sorted, without installed third-party packages."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"corpus folder {root} does not exist; pass --corpus DIR with text files in it")
    files = [p for p in root.rglob(pattern)
             if p.is_file() and not {"site-packages", "dist-packages", "__pycache__"} & set(p.parts)]
    return sorted(files)


def read_documents(root: Path, pattern: str = "*.py") -> list[Document]:
    """Read the corpus; files that are not UTF-8, empty or huge are skipped."""
    root = Path(root)
    docs = []
    for path in list_files(root, pattern):
        raw = path.read_bytes()
        if not raw.strip() or len(raw) > MAX_FILE_BYTES:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        docs.append(Document(path.relative_to(root).as_posix(), text))
    if not docs:
        raise ConfigError(f"corpus folder {root} has no readable {pattern} files")
    return docs


def is_heldout(rel_path: str, heldout_fraction: float) -> bool:
    """Deterministic per-file split: a file is held out when its path hashes into the first fraction."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def split_documents(docs: list[Document], heldout_fraction: float = 0.05) -> tuple[list[Document], list[Document]]:
    train = [d for d in docs if not is_heldout(d.path, heldout_fraction)]
    heldout = [d for d in docs if is_heldout(d.path, heldout_fraction)]
    return train, heldout


def token_cache_path(folder: Path, tokenizer_dir: Path, docs: list[Document]) -> Path:
    """Where the token array of these documents under this tokenizer is cached; any change to either gives a
    new name, so a stale cache is never read."""
    digest = hashlib.sha256((Path(tokenizer_dir) / "tokenizer.json").read_bytes())
    for d in docs:
        digest.update(f"{d.path}\0{len(d.text)}\0".encode())
    return Path(folder) / f"tokens-{digest.hexdigest()[:16]}.npy"


def tokenize_documents(docs: list[Document], tokenizer, cache_path: Path | None = None) -> np.ndarray:
    """Concatenate the documents as BOS text EOS BOS text EOS ... into one uint16 array, cached on disk."""
    if cache_path is not None and Path(cache_path).is_file():
        return np.load(cache_path)
    backend = tokenizer.backend
    if tokenizer.vocab_size > 2**16:
        raise ConfigError("token ids are stored as uint16; vocabularies above 65536 are not supported")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_ids[0]
    pieces = []
    for encoding in backend.encode_batch([d.text for d in docs], add_special_tokens=False):
        pieces.append(np.array([bos, *encoding.ids, eos], dtype=np.uint16))
    tokens = np.concatenate(pieces)
    if cache_path is not None:
        Path(cache_path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(cache_path).with_suffix(".tmp.npy")
        np.save(tmp, tokens)
        tmp.replace(cache_path)
    return tokens


def sample_windows(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """A batch [batch_size, seq_len + 1] of random windows; a function of (seed, step) only, so resuming at a
    step sees exactly the batches an uninterrupted run would have seen."""
    if len(tokens) <= seq_len + 1:
        raise ConfigError(f"the corpus has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    return np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64)
