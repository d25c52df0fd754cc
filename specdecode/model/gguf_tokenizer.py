"""The tokenizer a GGUF file describes (byte-level BPE: vocabulary, merges, pre-tokenizer name, special token
ids, chat template), rebuilt with the `tokenizers` library so that transformers is not needed at run time.

It is built the way transformers builds it from the same file, so token ids match transformers' GGUF tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from specdecode.errors import ConfigError
from specdecode.model.gguf import GGUFCheckpoint

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)
"""tokenizer.ggml.model values we can build (byte-level BPE)."""

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
"""tokenizer.ggml.pre -> the split regex its merges were learned with; any other name gets GPT-2's split."""
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
END_TOKENS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                        "<EOT>", "<|end_of_text|>"})
"""Control tokens that end a generation in any GGUF (llama.cpp's end-of-generation set)."""


@dataclass
class GGUFTokenizerSpec:
    """What the Tokenizer class needs from a GGUF: the backend plus the special tokens and template."""

    backend: HFTokenizer
    """The byte-level BPE tokenizer."""
    bos_token: str | None
    """Beginning-of-sequence token text."""
    eos_token: str | None
    """End-of-sequence token text."""
    pad_token: str | None
    """Padding token text."""
    eos_token_ids: list[int]
    """Every id that ends generation (EOS and end-of-turn)."""
    add_bos_token: bool
    """Whether encode() prepends BOS."""
    chat_template: str | None
    """Jinja chat template from the metadata."""


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def build_gguf_tokenizer(ckpt: GGUFCheckpoint) -> GGUFTokenizerSpec:
    kind = ckpt.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise ConfigError(f"{ckpt.path}: tokenizer model {kind!r} is not supported; specdecode builds "
                          f"{', '.join(SUPPORTED_TOKENIZER_MODELS)} (byte-level BPE) tokenizers from GGUF files")
    tokens = list(ckpt.get("tokenizer.ggml.tokens"))
    token_types = list(ckpt.get("tokenizer.ggml.token_type") or [])
    merges = [tuple(m.split(" ", 1)) for m in ckpt.get("tokenizer.ggml.merges") or []]
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (rare, written in plain text by some converters) is respelled in it.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                     byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(ckpt.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) stay whole and are special; a "control" token outside the byte alphabet
    # is a converter's mislabel and would grow the vocabulary, so it is skipped (as transformers does).
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind in zip(tokens, token_types) if kind == CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, token_types) if kind == USER_DEFINED and t in vocab])

    def token_text(key: str) -> str | None:
        index = ckpt.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    eos_ids = [ckpt.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    # and the control tokens that end a generation whatever the metadata names (llama.cpp's rule): a Qwen2.5 file
    # names <|im_end|> only, and its model also ends answers with <|endoftext|> (its generation_config has both)
    eos_ids += [i for i, (t, kind) in enumerate(zip(tokens, token_types)) if kind == CONTROL and t in END_TOKENS]
    return GGUFTokenizerSpec(
        backend=backend, bos_token=token_text("bos_token_id"), eos_token=token_text("eos_token_id"),
        pad_token=token_text("padding_token_id"), eos_token_ids=sorted({i for i in eos_ids if i is not None}),
        add_bos_token=bool(ckpt.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=ckpt.get("tokenizer.chat_template"))
