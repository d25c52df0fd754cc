"""Rank the Qwen2.5 vocabulary by what Qwen2.5-Coder-1.5B-Instruct itself emits, for a draft's restricted head
(specdecode/catalog/token_ranks.py; FR-Spec). Writes specdecode/catalog/token_ranks/qwen2.5.json.

Two counts, both over text that none of the held-out benchmark prompts come from:
- the target's own greedy token at every position of teacher-forced text (its argmax given the true prefix): ShareGPT
  answers (train split) in the chat template and standard-library Python (files holding a `bench assistant` edit
  prompt's function skipped), as many tokens as --seconds of one-thread prefill allow;
- the tokens of a larger amount of the same kinds of text (cheap: tokenising only).
A token's score is its share of the first count plus its share of the second: what the target emits comes first, and
the text's own frequencies order the long tail the first count is too short to see. Ties go to the lower id.

    python docs/bench/draft_vocab_2026-12-05/count_tokens.py --seconds 420
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import sysconfig
import time
from pathlib import Path

import torch

from specdecode.catalog import sharegpt
from specdecode.catalog.registry import model_path
from specdecode.catalog.token_ranks import RANKS_DIR, vocabulary_fingerprint
from specdecode.model.loading import load_model, read_config
from specdecode.model.tokenizer import Tokenizer

KEEP = 65536
WORKLOADS = Path(__file__).resolve().parents[3] / "specdecode" / "bench" / "workloads"


def heldout_functions() -> list[str]:
    prompts = json.loads((WORKLOADS / "grounded_edit.json").read_text())["prompts"]
    return [p.strip().splitlines()[0].strip() for p in prompts]


def stdlib_texts(limit_chars: int) -> list[str]:
    skip = heldout_functions()
    out, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts or "idlelib" in path.parts:
            continue
        text = path.read_text(errors="ignore")
        if any(line in text for line in skip):
            continue
        out.append(text)
        total += len(text)
        if total >= limit_chars:
            break
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--seconds", type=float, default=420.0, help="budget of the target's teacher-forced prefill")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--corpus-conversations", type=int, default=3000)
    p.add_argument("--corpus-code-chars", type=int, default=6_000_000)
    p.add_argument("--out", type=Path, default=RANKS_DIR / "qwen2.5.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    path = model_path(args.model)
    config = read_config(path)
    tokenizer = Tokenizer(path, config.eos_token_ids)
    V = config.vocab_size

    conversations = sharegpt.load_conversations(sharegpt.fetch(quiet=True))
    train, _ = sharegpt.split(conversations)
    code = stdlib_texts(args.corpus_code_chars)

    # The text's own tokens (cheap).
    corpus = collections.Counter()
    for conv in train[:args.corpus_conversations]:
        for m in conv.messages:
            if m["role"] == "assistant":
                corpus.update(tokenizer.encode(m["content"], add_special_tokens=False))
    chat_tokens = sum(corpus.values())
    for text in code:
        corpus.update(tokenizer.encode(text, add_special_tokens=False))
    print(f"corpus: {sum(corpus.values())} tokens ({chat_tokens} ShareGPT answers, the rest stdlib), "
          f"{len(corpus)} distinct", file=sys.stderr)

    # The target's own greedy tokens on teacher-forced text: alternate a chat chunk and a code chunk.
    target = load_model(path, dtype=torch.float32, quantization="gguf")
    chats = (sharegpt.render_tokens(c, tokenizer, args.chunk) for c in train[args.corpus_conversations:])
    codes = (tokenizer.encode(t, add_special_tokens=False) for t in code[::-1])  # (others than the corpus' first)
    emitted = collections.Counter()
    kinds = collections.Counter()
    start = time.perf_counter()
    with torch.no_grad():
        while time.perf_counter() - start < args.seconds:
            for kind in ("chat", "code"):
                if kind == "chat":
                    ids, answer = next(chats)
                    if sum(answer) < 32:
                        continue
                else:
                    ids = next(codes)
                    start_at = len(ids) // 3  # a middle chunk of the file
                    ids = ids[start_at:start_at + args.chunk]
                    answer = [True] * len(ids)
                    if len(ids) < 32:
                        continue
                logits = target(torch.tensor([ids])).logits[0]  # [T, V]
                predicted = logits.argmax(-1)[:-1].tolist()  # the target's token for position t + 1
                for t, is_answer in zip(predicted, answer[1:]):
                    if is_answer:
                        emitted[t] += 1
                        kinds[kind] += 1
            print(f"{sum(kinds.values())} positions, {time.perf_counter() - start:.0f} s", file=sys.stderr)
    elapsed = time.perf_counter() - start
    print(f"target: {sum(emitted.values())} positions ({dict(kinds)}) in {elapsed:.0f} s, {len(emitted)} distinct",
          file=sys.stderr)

    e_total, c_total = sum(emitted.values()), sum(corpus.values())
    score = {t: emitted[t] / e_total + corpus[t] / c_total for t in set(emitted) | set(corpus) if t < V}
    ranked = sorted(score, key=lambda t: (-score[t], t))
    rest = [t for t in range(V) if t not in score]
    ids = (ranked + rest)[:KEEP]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"vocabulary": vocabulary_fingerprint(tokenizer.get_vocab()), "vocab_size": V,
              "counted_with": args.model,
              "counts": {"target_positions": e_total, "target_positions_by_kind": dict(kinds),
                         "target_distinct": len(emitted), "corpus_tokens": c_total, "corpus_distinct": len(corpus),
                         "sharegpt_answer_tokens": chat_tokens, "seconds": round(elapsed)},
              "command": " ".join(sys.argv),
              "ids": ids}
    args.out.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    cover = collections.Counter()
    for n in (8192, 16384, 32768, 65536):
        top = set(ids[:n])
        cover[n] = (sum(c for t, c in emitted.items() if t in top) / e_total,
                    sum(1 for t in emitted if t < n) and sum(c for t, c in emitted.items() if t < n) / e_total)
    print(json.dumps({"coverage of the target's tokens: ranked / lowest ids": {n: [round(a, 4), round(b, 4)]
                                                                             for n, (a, b) in cover.items()}}),
          file=sys.stderr)


if __name__ == "__main__":
    main()
