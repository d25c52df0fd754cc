"""Item 2's quick experiment: Qwen2.5-Coder-0.5B with its last layers dropped (final norm and head kept), no
training, as a draft for the 1.5B. Per depth kept: how often its greedy token (within the shipped ranking's first N)
is the 1.5B's on held-out code prompts (the 1.5B's greedy answers that choose_n.py saved, teacher-forced), and one
draft level's time (a one-token cached forward), in interleaved rounds.

    python docs/bench/draft_vocab_2026-12-05/shallow_draft.py --layers 24,20,16,12 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specdecode.catalog.registry import model_path
from specdecode.catalog.token_ranks import ranked_tokens, vocabulary_fingerprint
from specdecode.model.loading import load_model, read_config
from specdecode.model.quant import lighten
from specdecode.model.tokenizer import Tokenizer
from specdecode.speculation.proposers.draft_model import DRAFT_VOCAB, draft_head

HERE = Path(__file__).resolve().parent


def keep_layers(model, n: int, all_layers) -> None:
    model.model.layers = torch.nn.ModuleList(all_layers[:n])
    model.config.num_hidden_layers = n
    model.__dict__.pop("_fused_layers", None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default="24,20,16,12")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    depths = [int(x) for x in args.layers.split(",")]
    draft_path = model_path("qwen2.5-coder-0.5b-instruct")
    config = read_config(draft_path)
    ranked = ranked_tokens(vocabulary_fingerprint(Tokenizer(draft_path, config.eos_token_ids).get_vocab()))
    answers = json.loads((HERE / "answers.json").read_text())
    draft = load_model(draft_path, dtype=torch.float32, quantization="gguf")
    draft.lm_head = draft_head(draft.lm_head, ranked[:DRAFT_VOCAB])
    lighten(draft)
    all_layers = list(draft.model.layers)
    agreement = {}
    with torch.no_grad():
        for n in depths:
            keep_layers(draft, n, all_layers)
            hits = positions = 0
            for prompt_ids, answer in answers:
                ids = prompt_ids + answer
                guess = draft(torch.tensor([ids])).logits[0, len(prompt_ids) - 1:len(ids) - 1].argmax(-1)
                hits += int((guess == torch.tensor(answer)).sum())
                positions += len(answer)
            agreement[n] = hits / positions
        times = {n: [] for n in depths}
        context = torch.tensor([answers[0][0][:200]])
        token = torch.tensor([[answers[0][1][0]]])
        caches = {}
        for n in depths:
            keep_layers(draft, n, all_layers)
            caches[n] = draft.make_cache(1, 512)
            draft(context, cache=caches[n], compute_logits=False)
            caches[n].advance(torch.tensor([0]), torch.tensor([context.shape[1]]))
        for _ in range(args.rounds):
            for n in depths:
                keep_layers(draft, n, all_layers)
                draft(token, cache=caches[n])
                t = time.perf_counter()
                for _ in range(5):
                    draft(token, cache=caches[n])
                times[n].append((time.perf_counter() - t) / 5)
    result = {"positions": positions, "agreement_depth1": agreement,
              "level_ms_median": {n: 1000 * statistics.median(ts) for n, ts in times.items()},
              "level_ms_min_max": {n: [1000 * min(ts), 1000 * max(ts)] for n, ts in times.items()},
              "head_tokens": DRAFT_VOCAB, "command": " ".join(sys.argv)}
    (HERE / "shallow_draft.json").write_text(json.dumps(result, indent=1) + "\n")
    for n in depths:
        print(f"{n:>2} layers: agreement {agreement[n]:.3f}  level {result['level_ms_median'][n]:.2f} ms")


if __name__ == "__main__":
    main()
