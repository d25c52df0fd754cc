"""A tiny random checkpoint whose vocabulary has Qwen2.5-Coder's fill-in-the-middle tokens (plumbing tests), and where
the real 1.5B's GGUF lies when it was fetched (tests that must show the real format)."""
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.conftest import CORPUS, make_checkpoint

FIM_SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                "<|repo_name|>", "<|file_sep|>", "<|endoftext|>"]
"""Qwen2.5-Coder's FIM tokens after the tiny models' own three (ids in this order)."""


def write_fim_tokenizer(folder: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=FIM_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="session")
def fim_models(tmp_path_factory):
    """{"target": dir, "draft": dir (a noisy copy)}: tiny random models with FIM tokens in their vocabulary."""
    root = tmp_path_factory.mktemp("tiny-fim")
    write_fim_tokenizer(root / "tok")
    target = make_checkpoint(root / "target", root / "tok", seed=3, layers=2)
    make_checkpoint(root / "draft", root / "tok", seed=4, layers=2, base=target, noise=0.005)
    return {"target": root / "target", "draft": root / "draft"}


QWEN_15B = Path.home() / ".cache" / "specdecode" / "models" / "qwen2.5-coder-1.5b-instruct"


@pytest.fixture(scope="session")
def qwen_coder():
    """The folder of qwen2.5-coder-1.5b-instruct's GGUF in the user's cache (not fetched here: skipped without)."""
    if not any(QWEN_15B.glob("*.gguf")):
        pytest.skip(f"qwen2.5-coder-1.5b-instruct is not in {QWEN_15B.parent} (`specdecode pull` it)")
    return QWEN_15B
