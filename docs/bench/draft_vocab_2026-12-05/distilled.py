# Record: how the distilled shallow draft of docs/bench/draft_vocab_2026-12-05/README.md was compared.
"""Issue 48 item 2: drafts for the 1.5B compared on the held-out code answers of answers.json (the 1.5B's greedy
answers, teacher-forced): depth-1 agreement with the 1.5B (the draft's best token within the ranked 32,768 is the
1.5B's), one draft level's time (a one-token cached forward after 200 tokens; interleaved rounds, one thread,
median) and the expected tokens per second of a K-level chain relative to plain decoding,
E / (pass(K + 1) + K level / step) with E = (1 - a^(K+1)) / (1 - a).

    python docs/bench/draft_vocab_2026-12-05/distilled.py DRAFT_DIR [DRAFT_DIR ...] --layers 12 --rounds 5

Each DRAFT_DIR (`specdecode train draft --draft-init ...`) is quantized to Q4_0 as the shipped 0.5B is lightened;
also timed: the 0.5B as specdecode loads it, and the 0.5B cut to --layers layers without training (the same cut).
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
from specdecode.model.loading import load_model
from specdecode.model.quant import lighten
from specdecode.model.tokenizer import Tokenizer
from specdecode.speculation.proposers.draft_model import DRAFT_VOCAB, draft_head, frequent_tokens
from specdecode.train.heads import cut_layers

HERE = Path(__file__).resolve().parent
PASS_COST = {2: 1.1, 3: 1.2, 4: 1.28, 5: 1.36}
"""A pass over w tokens in target steps, one thread, this Intel core (wide_pass_2026-12-05: 5 tokens 1.36x; the
narrower ones interpolated towards 1)."""


def prepared(model, tokenizer):
    model.lm_head = draft_head(model.lm_head, frequent_tokens(tokenizer, model.config.vocab_size, DRAFT_VOCAB))
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("drafts", nargs="*", type=Path)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--step-ms", type=float, default=74.9, help="the 1.5B's one-token step (streams.py, same core)")
    args = p.parse_args()
    torch.set_num_threads(1)
    base = model_path("qwen2.5-coder-0.5b-instruct")
    tokenizer = Tokenizer(base, None)
    drafts = {}
    shipped = prepared(load_model(base, dtype="float32", quantization="gguf"), tokenizer)
    lighten(shipped)
    drafts["0.5B as shipped (24 layers)"] = shipped
    cut = cut_layers(load_model(base, dtype="float32", quantization="gguf"), args.layers)
    cut = prepared(cut, tokenizer)
    lighten(cut)
    drafts[f"0.5B cut to {args.layers} layers, untrained"] = cut
    for folder in args.drafts:
        drafts[f"{folder.name} (Q4_0)"] = prepared(load_model(folder, dtype="float32", quantization="q4_0"), tokenizer)
    answers = json.loads((HERE / "answers.json").read_text())
    agreement, times = {}, {name: [] for name in drafts}
    with torch.inference_mode():
        for name, model in drafts.items():
            hits = positions = 0
            for prompt_ids, answer in answers:
                ids = prompt_ids + answer
                guess = model(torch.tensor([ids])).logits[0, len(prompt_ids) - 1:len(ids) - 1].argmax(-1)
                hits += int((guess == torch.tensor(answer)).sum())
                positions += len(answer)
            agreement[name] = hits / positions
        context, token = torch.tensor([answers[0][0][:200]]), torch.tensor([[answers[0][1][0]]])
        caches = {}
        for name, model in drafts.items():
            caches[name] = model.make_cache(1, 512)
            model(context, cache=caches[name], compute_logits=False)
            caches[name].advance(torch.tensor([0]), torch.tensor([context.shape[1]]))
        for _ in range(args.rounds):
            for name, model in drafts.items():
                model(token, cache=caches[name])
                start = time.perf_counter()
                for _ in range(5):
                    model(token, cache=caches[name])
                times[name].append((time.perf_counter() - start) / 5)
    rows = {}
    for name in drafts:
        a, level = agreement[name], 1000 * statistics.median(times[name])
        speed = {k: round((1 - a ** (k + 1)) / (1 - a) / (PASS_COST[k + 1] + k * level / args.step_ms), 3)
                 for k in (1, 2, 3, 4)}
        rows[name] = {"agreement_depth1": round(a, 4), "level_ms": round(level, 2),
                      "level_per_step": round(level / args.step_ms, 3), "expected_speed_over_plain_by_k": speed}
        print(f"{name}: agreement {a:.3f}, level {level:.2f} ms ({level / args.step_ms:.3f} of a step), "
              f"expected x plain by K {speed}", flush=True)
    out = {"cpu": next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
           "positions": positions, "drafts": rows, "command": "python " + " ".join(sys.argv)}
    (HERE / "distilled.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
