"""Shipped token rankings: for a vocabulary, its token ids ordered by how often a target model emits them, so that a
draft can score only the tokens that matter (FR-Spec, arXiv 2502.14856: the draft's output head restricted to the
most frequent tokens; the target still verifies over its whole vocabulary, so the output does not change).

A ranking is a JSON file in catalog/token_ranks/ naming the vocabulary it is for by a fingerprint of its tokens
(vocabulary_fingerprint), how it was counted, and the ranked ids. docs/bench/draft_vocab_2026-12-05 holds the script
that counted the shipped one and the measurement that chose how many of its ids a draft keeps.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

RANKS_DIR = Path(__file__).resolve().parent / "token_ranks"


def vocabulary_fingerprint(vocab: dict[str, int]) -> str:
    """sha256 of the vocabulary's tokens in id order (what a ranking file names as its "vocabulary")."""
    digest = hashlib.sha256()
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{token}\n".encode())
    return digest.hexdigest()


@functools.lru_cache(maxsize=4)
def _rankings() -> dict[str, Path]:
    out = {}
    for path in sorted(RANKS_DIR.glob("*.json")):
        with path.open() as f:
            head = json.load(f)
        out[head["vocabulary"]] = path
    return out


def ranked_tokens(fingerprint: str) -> list[int] | None:
    """The shipped ranking for the vocabulary with this fingerprint, most frequent first (None: none is shipped)."""
    path = _rankings().get(fingerprint)
    if path is None:
        return None
    with path.open() as f:
        return list(json.load(f)["ids"])
