"""Byte-level BPE tokenizer training (the `tokenizers` library), saved as a Hugging Face tokenizer.

Special tokens: <|bos|> (prepended to every encoded text, `add_bos_token: true`), <|eos|> (ends every training
document; generation stops on it) and <|pad|>. The BOS is added both by tokenizer.json's post-processor (for
transformers) and by tokenizer_config.json's add_bos_token (for specdecode's Tokenizer, which encodes without
the post-processor), so both libraries produce the same ids.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2


def train_bpe(texts, vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE on an iterable of strings."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(special_token_ids(tok), indent=2) + "\n")


def special_token_ids(tok: Tokenizer) -> dict:
    return {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS),
            "pad_token_id": tok.token_to_id(PAD)}


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> None:
    dst_dir = Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        (dst_dir / name).write_bytes((Path(src_dir) / name).read_bytes())
