"""How many of the ranked tokens a Qwen2.5-Coder-0.5B draft should keep when drafting for the 1.5B: per N, how often
the draft's best token within its N (its depth-1 guess) is the 1.5B's greedy token, on held-out code prompts (the
1.5B's own greedy answers, teacher-forced through the draft), and what one draft level costs (a one-token cached
forward of the draft, lightened as specdecode loads it), timed in interleaved rounds.

    python docs/bench/draft_vocab_2026-12-05/choose_n.py --prompts 4 --max-tokens 96 --rounds 5
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
from specdecode.engine.llm import LLM
from specdecode.model.loading import load_model, read_config
from specdecode.model.quant import lighten
from specdecode.model.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams
from specdecode.speculation.proposers.draft_model import draft_head

WORKLOADS = Path(__file__).resolve().parents[3] / "specdecode" / "bench" / "workloads"
SIZES = (8192, 16384, 24576, 32768, 49152, 65536)


def prompts(tokenizer, n: int) -> list[str]:
    problems = json.loads((WORKLOADS / "code_problems.json").read_text())["problems"]
    edits = json.loads((WORKLOADS / "grounded_edit.json").read_text())["prompts"]
    asks = [p["prompt"] for p in problems[-n:]]  # (the last ones: `bench assistant --prompts 2` takes the first)
    asks += ["Add type hints to this function and return the whole function, otherwise unchanged.\n\n```python\n"
             + e.split("\n\n\n# The same function")[0] + "\n```" for e in edits[-n:]]
    return [tokenizer.apply_chat_template([{"role": "user", "content": a}]) for a in asks]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=4, help="per kind (problems, edits)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "choose_n.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    target_path, draft_path = model_path("qwen2.5-coder-1.5b-instruct"), model_path("qwen2.5-coder-0.5b-instruct")
    config = read_config(target_path)
    tokenizer = Tokenizer(target_path, config.eos_token_ids)
    V = config.vocab_size
    ranked = ranked_tokens(vocabulary_fingerprint(tokenizer.get_vocab()))
    assert ranked is not None, "no shipped ranking for this vocabulary"

    # The 1.5B's greedy answers.
    texts = prompts(tokenizer, args.prompts)
    llm = LLM(str(target_path), max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    answers = []
    t0 = time.perf_counter()
    for text in texts:
        out = llm.generate(text, params)[0]
        answers.append((tokenizer.encode(text, add_special_tokens=False), list(out.outputs[0].token_ids)))
    print(f"target answers: {sum(len(a) for _, a in answers)} tokens in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    args.out.with_name("answers.json").write_text(json.dumps(answers) + "\n")  # (shallow_draft.py reads them)
    del llm

    # Depth-1 agreement per N: the draft's full logits once, then its best token within each set.
    draft = load_model(draft_path, dtype=torch.float32, quantization="gguf")
    lighten(draft)  # as specdecode loads a GGUF draft (the head is cut before, the rest is the same)
    sets = {"whole head": None}
    for n in SIZES:
        sets[f"ranked {n}"] = torch.tensor(ranked[:n])
        sets[f"ids < {n}"] = torch.arange(n)
    hits = {name: 0 for name in sets}
    positions = 0
    with torch.no_grad():
        for prompt_ids, answer in answers:
            ids = prompt_ids + answer
            logits = draft(torch.tensor([ids])).logits[0, len(prompt_ids) - 1:len(ids) - 1]  # [A, V]
            truth = torch.tensor(answer)
            positions += len(answer)
            for name, subset in sets.items():
                if subset is None:
                    guess = logits.argmax(-1)
                else:
                    guess = subset[logits[:, subset].argmax(-1)]
                hits[name] += int((guess == truth).sum())
    agreement = {name: hits[name] / positions for name in sets}

    # One draft level's time per N (a one-token cached forward after a 200-token context), interleaved.
    head = draft.lm_head
    heads = {"whole head": head}
    for n in SIZES:
        heads[f"ranked {n}"] = lighten_head(draft_head(head, ranked[:n]))
        heads[f"ids < {n}"] = lighten_head(draft_head(head, list(range(n))))
    cache = draft.make_cache(1, 512)
    context = torch.tensor([answers[0][0][:200]])
    draft.lm_head = head
    with torch.no_grad():
        draft(context, cache=cache, compute_logits=False)
        cache.advance(torch.tensor([0]), torch.tensor([context.shape[1]]))
        token = torch.tensor([[answers[0][1][0]]])
        times = {name: [] for name in heads}
        for _ in range(args.rounds):
            for name, h in heads.items():
                draft.lm_head = h
                draft(token, cache=cache)  # warm
                t = time.perf_counter()
                for _ in range(5):
                    draft(token, cache=cache)
                times[name].append((time.perf_counter() - t) / 5)
    level_ms = {name: 1000 * statistics.median(ts) for name, ts in times.items()}
    spread = {name: [round(1000 * min(ts), 2), round(1000 * max(ts), 2)] for name, ts in times.items()}
    result = {"positions": positions, "prompts": len(texts), "agreement_depth1": agreement,
              "draft_level_ms_median": level_ms, "draft_level_ms_min_max": spread, "rounds": args.rounds,
              "command": " ".join(sys.argv)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name in sets:
        print(f"{name:>14}: agreement {agreement[name]:.3f}  level {level_ms[name]:.2f} ms {spread[name]}")


def lighten_head(head):
    """The cut head in Q4_0 as lighten() leaves a loaded draft's (a SubsetHead's rows)."""
    holder = torch.nn.Module()
    holder.head = head
    lighten(holder)
    return holder.head


if __name__ == "__main__":
    main()
