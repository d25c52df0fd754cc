"""Fill-in-the-middle prompts: the code before and after the cursor (and other files of the project) wrapped in the
special tokens a code model was trained with, so that what it writes next is the middle. Qwen2.5-Coder's format (its
model card; StarCoder's is the same under other token names):

    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>                         one file
    <|repo_name|>{name}\n<|file_sep|>{path}\n{text}...<|file_sep|>{path}\n<|fim_prefix|>...   repo-level

The model ends a middle with <|endoftext|> (or starts another file: <|file_sep|>), so a fill-in-the-middle request
stops on those too (FimTokens.stop_ids), as llama.cpp's end-of-generation tokens do.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specdecode.errors import ConfigError

FORMATS = (
    # prefix, suffix, middle, repo name, file separator, tokens that end a middle besides the EOS
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>",
     ("<|endoftext|>", "<|fim_pad|>")),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<reponame>", "<file_sep>", ("<|endoftext|>", "<fim_pad>")),
)
"""Token names of the FIM formats known, Qwen2.5-Coder's first; a vocabulary holding the first three names of one
has it."""

REPO_NAME = "myproject"
CURRENT_FILE = "filename"
"""What llama.cpp's /infill writes as the repository's and the edited file's names (its body has no field for
them), kept so that the same body gives the same tokens here."""

PREFIX_TAKE, SUFFIX_TAKE = 1536, 512
"""Most tokens of the prefix (its end) and of the suffix (its start) an /infill prompt keeps: llama.cpp's 3/4 and
1/4 of its default batch of 2048."""


@dataclasses.dataclass(frozen=True)
class FimTokens:
    """The ids of a vocabulary's FIM tokens."""

    prefix: int
    suffix: int
    middle: int
    repo_name: int | None
    """None: the vocabulary has no repo-level tokens (extra files are then separated by text)."""
    file_sep: int | None
    stop_ids: tuple[int, ...]
    """Tokens that end a middle besides the model's EOS: end of text, padding, a new file or repository."""


def fim_tokens(tokenizer) -> FimTokens | None:
    """The tokenizer's FIM tokens, or None when its vocabulary has none (such a model was not trained to fill in)."""
    vocab = tokenizer.get_vocab()
    for prefix, suffix, middle, repo, sep, ends in FORMATS:
        if all(name in vocab for name in (prefix, suffix, middle)):
            stops = [vocab[n] for n in (*ends, repo, sep) if n in vocab]
            return FimTokens(vocab[prefix], vocab[suffix], vocab[middle], vocab.get(repo), vocab.get(sep),
                             tuple(sorted(set(stops))))
    return None


def require_fim(tokenizer, what: str = "suffix") -> FimTokens:
    """fim_tokens, or a ConfigError that says what is missing."""
    fim = fim_tokens(tokenizer)
    if fim is None:
        raise ConfigError(f"{what} needs a model trained for fill-in-the-middle: this model's vocabulary has no "
                          f"{FORMATS[0][0]}, {FORMATS[0][1]}, {FORMATS[0][2]} tokens (Qwen2.5-Coder has them, "
                          "e.g. qwen2.5-coder-1.5b-instruct)")
    return fim


def fim_ids(tokenizer, fim: FimTokens, prefix: str, suffix: str) -> list[int]:
    """The model card's one-file prompt: <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|> (after the BOS
    of a tokenizer that adds one)."""
    return [*_bos(tokenizer), fim.prefix, *_encode(tokenizer, prefix), fim.suffix, *_encode(tokenizer, suffix),
            fim.middle]


def infill_ids(tokenizer, fim: FimTokens, prefix: str, suffix: str, typed: str = "",
               files: Sequence[tuple[str, str]] = (), max_tokens: int | None = None,
               current_file: str = CURRENT_FILE) -> list[int]:
    """llama.cpp's /infill prompt (its format_prompt_infill), token for token: the repo-level format with the other
    files (filename, text) before the edited one, then <|fim_prefix|>{prefix}{typed}<|fim_suffix|>{suffix}
    <|fim_middle|> (a BOS the tokenizer adds goes right before <|fim_prefix|>, as there). typed: the text typed so far
    on the cursor's line (the body's "prompt"). The prefix keeps its last PREFIX_TAKE tokens, the suffix its first
    SUFFIX_TAKE less what typed takes. current_file: the edited file's name (llama.cpp's placeholder by default). Each
    piece is tokenized on its own, as there (the typed text does not merge with the end of the prefix).

    max_tokens: the most prompt tokens (None: no limit). What does not fit goes first from the other files (their
    start: the repository's name and the earliest files; llama.cpp's server too gives them only what the prefix, the
    suffix and the middle leave), then from the prefix (its start, far from the cursor), then from the suffix (its
    end). The special tokens and the typed text always stay: a prompt is longer than max_tokens only when they are."""
    head = _encode(tokenizer, prefix)[-PREFIX_TAKE:]
    typed_ids = _encode(tokenizer, typed)
    tail = _encode(tokenizer, suffix)[:max(0, SUFFIX_TAKE - 2 - len(typed_ids))]
    extra: list[int] = []
    if fim.repo_name is not None:
        extra += [fim.repo_name, *_encode(tokenizer, REPO_NAME + "\n")]
    for filename, text in files:
        if fim.file_sep is not None:
            extra += [fim.file_sep, *_encode(tokenizer, filename + "\n")]
        else:  # llama.cpp's separator for a vocabulary without one
            extra += _encode(tokenizer, "\n\n--- snippet ---\n\n")
        extra += _encode(tokenizer, text)
    if fim.file_sep is not None:
        extra += [fim.file_sep, *_encode(tokenizer, current_file + "\n")]
    if max_tokens is not None:
        room = max(0, max_tokens - len(_bos(tokenizer)) - 3 - len(typed_ids))  # for suffix, prefix, files
        tail = tail[:room]
        head = _last(head, room - len(tail))
        extra = _last(extra, room - len(tail) - len(head))
    return [*extra, *_bos(tokenizer), fim.prefix, *head, *typed_ids, fim.suffix, *tail, fim.middle]


def _last(ids: list[int], n: int) -> list[int]:
    """The last n ids (none when n <= 0)."""
    return ids[len(ids) - min(len(ids), max(0, n)):]


def _bos(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.add_bos_token and tokenizer.bos_token_id is not None else []


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []
