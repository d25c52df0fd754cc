"""REST's datastore: a corpus of token ids and its suffix array (libdivsufsort through pydivsufsort), built once
and memory-mapped at load; a lookup finds the longest suffix of a context (16 tokens down to 2) that occurs in
the corpus and returns what followed its occurrences.

A datastore is a directory: tokens.npy (every document's tokens, each followed by the separator, the tokenizer's
EOS), suffix_array.npy and datastore.json (the tokenizer's digest and vocabulary size, sizes, source).
`specdecode datastore build` writes one; the default model's is built from ShareGPT's training-split answers on
first use and cached. A datastore is checked when it is opened (ids in the vocabulary, the suffix array a sorted
permutation, on a sample), so a damaged one is refused in one line instead of failing a request later.
"""
from __future__ import annotations

import bisect
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable

import numpy as np
from tqdm import tqdm

from specdecode.errors import CheckpointError, ConfigError

FORMAT = 1
"""datastore.json's format version."""
ENCODE_BATCH = 512
"""Documents tokenised per call of the tokenizer (its Rust side runs a batch in parallel)."""
ORDER_SAMPLE = 4096
"""Adjacent suffix-array entries whose suffixes are compared at load (all of them in a smaller datastore)."""
ORDER_WINDOW = 64
"""Tokens of two adjacent suffixes compared at load; a pair equal that far is taken as ordered."""
BUILD_HINT = "build it again with `specdecode datastore build --model MODEL --data sharegpt|FILE --out DIR`"


@dataclasses.dataclass(frozen=True)
class DatastoreInfo:
    """datastore.json: what a datastore holds and which tokenizer made it."""

    tokenizer_digest: str
    """sha256 of the tokenizer's vocabulary (a datastore is only used with the same one)."""
    num_tokens: int
    """Corpus length in tokens, separators included."""
    documents: int
    """Documents in the corpus."""
    separator: int
    """Token id that ends every document (the tokenizer's EOS)."""
    source: str
    """Where the text came from."""
    format: int = FORMAT
    """Layout version."""
    vocab_size: int | None = None
    """The tokenizer's vocabulary size (None in datastores written before it was recorded)."""


def tokenizer_digest(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def build_datastore(documents: Iterable[str], tokenizer, out: Path, source: str, total: int | None = None,
                    progress: bool = True) -> DatastoreInfo:
    """Tokenise documents (in batches, with a progress bar) and write them as the datastore `out`."""
    pieces, batch = [], []
    bar = tqdm(total=total, desc="tokenising", unit="doc", disable=not progress)

    def flush():
        pieces.extend(e.ids for e in tokenizer.backend.encode_batch(batch, add_special_tokens=False))
        bar.update(len(batch))
        batch.clear()

    for text in documents:
        if text.strip():
            batch.append(text)
        if len(batch) == ENCODE_BATCH:
            flush()
    flush()
    bar.close()
    return write_datastore(pieces, tokenizer, out, source, progress=progress)


def write_datastore(documents: list[list[int]], tokenizer, out: Path, source: str, progress: bool = True
                    ) -> DatastoreInfo:
    """Token-id documents, each ended by the tokenizer's EOS, suffix-sorted and written as the datastore
    directory `out` (written next to it, then renamed into place)."""
    from pydivsufsort import divsufsort

    if not tokenizer.eos_token_ids:
        raise ConfigError("the tokenizer has no EOS token to end the datastore's documents with")
    if not documents:
        raise ConfigError(f"{source} holds no text to build a datastore from")
    separator = tokenizer.eos_token_ids[0]
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
    tokens = np.fromiter((t for doc in documents for t in (*doc, separator)), dtype=dtype)  # [T]
    if progress:
        print(f"suffix-sorting {len(tokens):,} tokens ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    suffix_array = divsufsort(tokens)  # [T] start of each suffix, in sorted order
    info = DatastoreInfo(tokenizer_digest(tokenizer), int(len(tokens)), len(documents), int(separator), source,
                         vocab_size=tokenizer.vocab_size)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        tmp.chmod(0o755)  # (mkdtemp's is 0700) readable like any other directory the user writes
        np.save(tmp / "tokens.npy", tokens)
        np.save(tmp / "suffix_array.npy", suffix_array)
        (tmp / "datastore.json").write_text(json.dumps(dataclasses.asdict(info), indent=1) + "\n")
        if out.exists():
            raise ConfigError(f"{out} already exists; remove it or choose another --out")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        print(f"datastore: {len(documents):,} documents, {len(tokens):,} tokens, sorted in "
              f"{time.perf_counter() - started:.0f} s -> {out}", file=sys.stderr, flush=True)
    return info


class Datastore:
    """A datastore directory, memory-mapped and checked (check_arrays), against a tokenizer when given one."""

    def __init__(self, folder: str | Path, tokenizer=None, remedy: str = BUILD_HINT):
        """remedy: what a refusal tells the user to do."""
        folder = Path(folder)
        try:
            raw = json.loads((folder / "datastore.json").read_text())
            self.info = DatastoreInfo(**raw)
            self.tokens = np.load(folder / "tokens.npy", mmap_mode="r")  # [T]
            self.suffix_array = np.load(folder / "suffix_array.npy", mmap_mode="r")  # [T] start of each suffix
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"{folder} is not a datastore ({exc}); write one with `specdecode datastore build "
                              "--model MODEL --data sharegpt|FILE --out DIR`") from None
        if self.info.format != FORMAT:
            raise ConfigError(f"{folder} holds a datastore of format {self.info.format!r}, not {FORMAT}; {remedy}")
        self.folder, self.remedy = folder, remedy
        check_info(folder, self.info, remedy)
        if tokenizer is not None:  # first: a wrong tokenizer explains damage the arrays' checks would report
            self._check_tokenizer(tokenizer)
        vocab = tokenizer.vocab_size if tokenizer is not None else self.info.vocab_size
        self.token_range = check_arrays(folder, self.info, self.tokens, self.suffix_array, vocab, remedy)

    def check(self, tokenizer) -> None:
        """Refuse a datastore made by another tokenizer or holding ids outside this one's vocabulary."""
        self._check_tokenizer(tokenizer)
        _check_ids(self.folder, self.token_range, self.info.separator, tokenizer.vocab_size, self.remedy)

    def _check_tokenizer(self, tokenizer) -> None:
        if tokenizer_digest(tokenizer) != self.info.tokenizer_digest:
            raise ConfigError(f"the datastore {self.folder} was built with another tokenizer than the model's; build "
                              "one for this model with `specdecode datastore build --model MODEL ...`")
        if self.info.vocab_size is not None and self.info.vocab_size != tokenizer.vocab_size:
            raise CheckpointError(f"{self.folder / 'datastore.json'} records a vocabulary of {self.info.vocab_size} "
                                  f"tokens but the model's tokenizer has {tokenizer.vocab_size}; {self.remedy}")

    def find(self, pattern: list[int]) -> tuple[int, int]:
        """[lo, hi): the suffix-array ranks of the suffixes that start with pattern."""
        ranks, length = range(len(self.suffix_array)), len(pattern)

        def prefix(rank: int) -> list[int]:  # the rank-th smallest suffix cut to the pattern's length
            start = int(self.suffix_array[rank])
            return self.tokens[start:start + length].tolist()

        lo = bisect.bisect_left(ranks, pattern, key=prefix)
        return lo, bisect.bisect_right(ranks, pattern, lo=lo, key=prefix)

    def longest_match(self, context: list[int], longest: int = 16, shortest: int = 2) -> tuple[int, int, int]:
        """(lo, hi, length) of the longest suffix of context, `longest` down to `shortest` tokens, found in the
        corpus; length 0 when none is. A suffix that occurs has shorter ones that occur too, so the longest is
        found by bisecting the length."""
        best = (0, 0, 0)
        low, high = shortest, min(longest, len(context))
        while low <= high:
            length = (low + high) // 2
            lo, hi = self.find(context[-length:])
            if hi > lo:
                best, low = (lo, hi, length), length + 1
            else:
                high = length - 1
        return best

    def continuations(self, context: list[int], depth: int, limit: int = 64, longest: int = 16,
                      shortest: int = 2) -> list[tuple[int, ...]]:
        """What followed the longest matched suffix of context: up to `limit` occurrences (spread evenly over
        them when there are more), `depth` tokens each, cut after a document's end."""
        lo, hi, length = self.longest_match(context, longest, shortest)
        if hi == lo:
            return []
        ranks = range(lo, hi) if hi - lo <= limit else (lo + (i * (hi - lo)) // limit for i in range(limit))
        out = []
        for rank in ranks:
            start = int(self.suffix_array[rank]) + length
            following = self.tokens[start:start + depth].tolist()
            if self.info.separator in following:
                following = following[:following.index(self.info.separator) + 1]
            if following:
                out.append(tuple(following))
        return out


def check_info(folder: Path, info: DatastoreInfo, remedy: str = BUILD_HINT) -> None:
    """Refuse a datastore.json whose counts are not integers."""
    for field in ("num_tokens", "documents", "separator"):
        if not _is_int(getattr(info, field)):
            raise CheckpointError(f"{folder / 'datastore.json'} records {field} {getattr(info, field)!r}, not an "
                                  f"integer; the datastore is damaged: {remedy}")
    if info.vocab_size is not None and (not _is_int(info.vocab_size) or info.vocab_size < 1):
        raise CheckpointError(f"{folder / 'datastore.json'} records vocab_size {info.vocab_size!r}, not a positive "
                              f"integer; the datastore is damaged: {remedy}")


def check_arrays(folder: Path, info: DatastoreInfo, tokens: np.ndarray, suffix_array: np.ndarray,
                 vocab: int | None, remedy: str = BUILD_HINT) -> tuple[int, int]:
    """Refuse (CheckpointError, one line naming the file) arrays that would fail or mislead lookups: not 1-D
    integers, lengths that disagree with each other or datastore.json, ids outside 0..vocab-1 (below 0 when vocab
    is None), a suffix array that is not a permutation of 0..T-1 (range and sum, all entries) or not sorted
    (ORDER_SAMPLE adjacent pairs). Vectorised: a few tens of milliseconds for millions of tokens. Returns the
    ids' (min, max)."""
    def refuse(name: str, what: str):
        raise CheckpointError(f"{folder / name} {what}; the datastore is damaged: {remedy}")

    for name, array in (("tokens.npy", tokens), ("suffix_array.npy", suffix_array)):
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            refuse(name, f"holds a {array.dtype} array of shape {array.shape}, not a 1-D array of integers")
    n = len(tokens)
    if n == 0:
        refuse("tokens.npy", "holds no tokens")
    if n != info.num_tokens:
        refuse("tokens.npy", f"holds {n:,} tokens but datastore.json records {info.num_tokens:,}")
    if len(suffix_array) != n:
        refuse("suffix_array.npy", f"has {len(suffix_array):,} entries for {n:,} tokens (need one per token)")
    token_range = int(tokens.min()), int(tokens.max())
    _check_ids(folder, token_range, info.separator, vocab, remedy)
    lowest, highest = int(suffix_array.min()), int(suffix_array.max())
    if lowest < 0 or highest >= n:
        refuse("suffix_array.npy", f"holds position {lowest if lowest < 0 else highest:,}, outside the corpus "
                                   f"(positions 0..{n - 1:,})")
    if int(suffix_array.sum(dtype=np.int64)) != n * (n - 1) // 2:
        refuse("suffix_array.npy", f"is not a permutation of the positions 0..{n - 1:,} (some repeat)")
    rank = unsorted_rank(tokens, suffix_array, ORDER_SAMPLE, ORDER_WINDOW)
    if rank is not None:
        refuse("suffix_array.npy", f"is not in suffix order: the suffix at position {int(suffix_array[rank]):,} "
                                   f"(rank {rank:,}) sorts after the one at {int(suffix_array[rank + 1]):,}")
    return token_range


def _check_ids(folder: Path, token_range: tuple[int, int], separator: int, vocab: int | None, remedy: str) -> None:
    """Refuse ids below 0 or (vocab given) at or above vocab: the target's embedding would fail on them."""
    for token in token_range:
        if token < 0 or (vocab is not None and token >= vocab):
            bound = f"the vocabulary of {vocab} ids (0..{vocab - 1})" if vocab is not None else "the vocabulary"
            raise CheckpointError(f"{folder / 'tokens.npy'} holds token id {token}, outside {bound}; the datastore "
                                  f"is damaged or was built for another model: {remedy}")
    if separator < 0 or (vocab is not None and separator >= vocab):
        raise CheckpointError(f"{folder / 'datastore.json'} records separator {separator}, outside the vocabulary; "
                              f"the datastore is damaged: {remedy}")


def unsorted_rank(tokens: np.ndarray, suffix_array: np.ndarray, sample: int = ORDER_SAMPLE,
                  window: int = ORDER_WINDOW) -> int | None:
    """A rank i (of `sample` adjacent pairs, drawn with a fixed seed; all pairs when there are fewer) whose suffix
    does not sort strictly before the next one's, comparing their first `window` tokens, a suffix that ends first
    being the smaller (libdivsufsort's order); None when every pair checked is ordered. Strictly: two suffixes of
    one corpus are never equal, so a repeated entry is caught too."""
    n = len(tokens)
    if n < 2:
        return None
    ranks = np.arange(n - 1) if n - 1 <= sample else \
        np.unique(np.random.default_rng(0).integers(0, n - 1, sample))  # [S]
    first = suffix_array[ranks].astype(np.int64)[:, None] + np.arange(window)  # [S, W] positions of each suffix
    second = suffix_array[ranks + 1].astype(np.int64)[:, None] + np.arange(window)  # [S, W]

    def read(positions):  # tokens at the positions, -1 past the corpus' end (smaller than any id)
        inside = positions < n
        return np.where(inside, tokens[np.where(inside, positions, 0)].astype(np.int64), -1)

    a, b = read(first), read(second)  # [S, W]
    differ = a != b  # [S, W]
    column = differ.argmax(axis=1)  # [S] first differing token (0 where none differs)
    rows = np.arange(len(ranks))
    wrong = (differ[rows, column] & (a[rows, column] > b[rows, column])) | (first[:, 0] == second[:, 0])  # [S]
    return int(ranks[wrong.argmax()]) if wrong.any() else None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- the named models' datastores ---------------------------------------------------------------------------------


def sharegpt_answers(progress: bool = True) -> tuple[list[str], str]:
    """The assistant turns of ShareGPT's training split (the held-out conversations stay out), and a label."""
    from specdecode.catalog import sharegpt

    train, _ = sharegpt.split(sharegpt.load_conversations(sharegpt.fetch(quiet=not progress)))
    answers = [m["content"] for c in train for m in c.messages if m["role"] == "assistant"]
    return answers, f"ShareGPT answers, training split ({len(train):,} conversations)"


def file_documents(path: Path) -> tuple[list[str], str]:
    """A conversation file's assistant turns (.json ShareGPT list or .jsonl), or a text file as one document."""
    from specdecode.catalog import sharegpt

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--data {path}: no such file; give `sharegpt` or a .json/.jsonl/.txt file")
    if path.suffix in (".json", ".jsonl"):
        conversations = sharegpt.load_conversations(path)
        return [m["content"] for c in conversations for m in c.messages if m["role"] == "assistant"], \
            f"answers of {path.name} ({len(conversations):,} conversations)"
    return [path.read_text(encoding="utf-8")], path.name


def named_model_of(target_dir: Path | None) -> str | None:
    """The registry name of a target loaded from the model cache, else None."""
    from specdecode.catalog.registry import MODELS, model_path

    if target_dir is None:
        return None
    target = Path(target_dir).resolve()
    return next((name for name in MODELS if model_path(name).resolve() == target), None)


def default_datastore(name: str, tokenizer, progress: bool = True) -> Path:
    """The named model's ShareGPT datastore in $SPECDECODE_CACHE/datastores, built on first use (a second
    process that asks meanwhile waits for the first)."""
    from specdecode.catalog.registry import cache_dir

    folder = cache_dir() / "datastores" / name / "sharegpt"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "datastore.json").is_file():
            if progress:
                print(f"specdecode: building the REST datastore of {name} from ShareGPT (once; a few minutes) "
                      f"into {folder}", file=sys.stderr, flush=True)
            answers, source = sharegpt_answers(progress)
            build_datastore(answers, tokenizer, folder, source, total=len(answers), progress=progress)
    return folder


def open_datastore(folder: str | Path | None, tokenizer, target_dir: Path | None) -> Datastore:
    """The datastore a rest config names, or (none named) the named target's default one; checked against the
    target's tokenizer."""
    if folder is None:
        name = named_model_of(target_dir)
        if name is None:
            raise ConfigError('the rest method needs "model" (--speculative-model): a datastore directory written by '
                              "`specdecode datastore build --model MODEL --data sharegpt|FILE --out DIR`; only named "
                              "models get one built on first use")
        folder = default_datastore(name, tokenizer)
        return Datastore(folder, tokenizer, remedy=f"delete {folder} and it is built again on the next use")
    return Datastore(folder, tokenizer)


# -- command line -------------------------------------------------------------------------------------------------
