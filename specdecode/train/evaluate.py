"""Evaluation on held-out files: the target's loss and perplexity, and how well a draft predicts the target:
greedy agreement along the target's own greedy continuations, and the expected acceptance rate of
speculative sampling at temperature 1, E[sum_x min(p(x), q(x))], along held-out text.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdecode.hardware import cpu_name
from specdecode.model.llama import LlamaForCausalLM
from specdecode.train.data import Document, tokenize_documents

GOALS = {"greedy_agreement": 0.60, "acceptance_t1": 0.55}


def heldout_windows(tokens: np.ndarray, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Evenly spaced, non-overlapping windows [N, seq_len + 1] covering about max_tokens positions."""
    total = (len(tokens) - 1) // seq_len
    count = max(1, min(total, max_tokens // seq_len))
    picks = np.linspace(0, total - 1, count).round().astype(int)
    return torch.from_numpy(np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in picks]).astype(np.int64))


def acceptance(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """sum_x min(p(x), q(x)) per position; logits [..., V] -> [...]."""
    return torch.minimum(p_logits.softmax(-1), q_logits.softmax(-1)).sum(-1)


@torch.no_grad()
def greedy_continue(model: LlamaForCausalLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuations [B, new_tokens] of prompts [B, P], batched through the KV cache."""
    B, P = prompts.shape
    cache = model.make_cache(B, P + new_tokens)
    slots = torch.arange(B)
    logits = model(prompts, cache=cache).logits[:, -1]  # [B, V]
    cache.advance(slots, P)
    out = []
    for _ in range(new_tokens):
        next_ids = logits.argmax(-1)  # [B]
        out.append(next_ids)
        logits = model(next_ids[:, None], cache=cache).logits[:, -1]
        cache.advance(slots, 1)
    return torch.stack(out, dim=1)


@torch.no_grad()
def evaluate(target: LlamaForCausalLM, draft: LlamaForCausalLM | None, tokenizer, docs: list[Document],
             max_tokens: int = 131072, seq_len: int = 512, prompts: int = 64, new_tokens: int = 64,
             prompt_len: int = 64, batch_size: int = 8) -> dict:
    started = time.time()
    tokens = tokenize_documents(docs, tokenizer)
    windows = heldout_windows(tokens, seq_len, max_tokens)  # [N, seq_len + 1]
    sums = {"target_nll": 0.0, "draft_nll": 0.0, "acceptance": 0.0, "agree_text": 0.0}
    positions = 0
    for batch in windows.split(batch_size):
        inputs, labels = batch[:, :-1], batch[:, 1:]
        p_logits = target(inputs).logits  # [b, T, V]
        sums["target_nll"] += F.cross_entropy(p_logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
        positions += labels.numel()
        if draft is not None:
            q_logits = draft(inputs).logits  # [b, T, V]
            sums["draft_nll"] += F.cross_entropy(q_logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
            sums["acceptance"] += acceptance(p_logits, q_logits).sum().item()
            sums["agree_text"] += (p_logits.argmax(-1) == q_logits.argmax(-1)).sum().item()
    target_loss = sums["target_nll"] / positions
    figures = {"heldout_files": len(docs), "heldout_tokens": int(len(tokens)), "scored_positions": positions,
               "target_loss": round(target_loss, 4), "target_perplexity": round(math.exp(target_loss), 3)}
    if draft is not None:
        draft_loss = sums["draft_nll"] / positions
        figures.update({"draft_loss": round(draft_loss, 4), "draft_perplexity": round(math.exp(draft_loss), 3),
                        "acceptance_t1": round(sums["acceptance"] / positions, 4),
                        "greedy_agreement_on_text": round(sums["agree_text"] / positions, 4)})
        figures.update(greedy_agreement(target, draft, tokens, prompts, prompt_len, new_tokens, batch_size))
    figures["eval_wall_time_s"] = round(time.time() - started, 1)
    return figures


@torch.no_grad()
def greedy_agreement(target, draft, tokens: np.ndarray, prompts: int, prompt_len: int, new_tokens: int,
                     batch_size: int) -> dict:
    """Share of positions along the target's greedy continuations where the draft's argmax is the target's."""
    starts = np.linspace(0, len(tokens) - prompt_len - 1, prompts).round().astype(int)
    prompt_ids = torch.from_numpy(np.stack([tokens[s:s + prompt_len] for s in starts]).astype(np.int64))
    agree = accept = count = 0.0
    for batch in prompt_ids.split(batch_size):
        continuation = greedy_continue(target, batch, new_tokens)  # [b, new_tokens]
        sequence = torch.cat([batch, continuation], dim=1)[:, :-1]  # the positions that predict each new token
        p_logits = target(sequence).logits[:, prompt_len - 1:]  # [b, new_tokens, V]
        q_logits = draft(sequence).logits[:, prompt_len - 1:]
        agree += (q_logits.argmax(-1) == p_logits.argmax(-1)).sum().item()
        accept += acceptance(p_logits, q_logits).sum().item()
        count += continuation.numel()
    return {"greedy_agreement": round(agree / count, 4), "acceptance_t1_on_greedy": round(accept / count, 4),
            "greedy_prompts": prompts, "greedy_prompt_len": prompt_len, "greedy_new_tokens": new_tokens}


def hardware() -> str:
    return (f"{os.cpu_count()}-core CPU ({cpu_name()}), {torch.get_num_threads()} torch threads, float32, "
            f"torch {torch.__version__}, no GPU")


def _mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e6


def write_model_card(out_dir: Path, stages: dict, corpus: Path, command: str) -> None:
    """MODEL_CARD.md from the recipe's stage log (data, recipe, sizes, wall time, evaluation)."""
    out_dir = Path(out_dir)
    tk, tg, dr, ev = stages["tokenizer"], stages["target"], stages["draft"], stages["eval"]
    t_cfg = json.loads((out_dir / "target" / "config.json").read_text())
    d_cfg = json.loads((out_dir / "draft" / "config.json").read_text())
    total_wall = sum(s.get("wall_time_s", 0.0) for s in stages.values())
    heldout_fraction = json.loads((out_dir / "heldout.json").read_text())["heldout_fraction"]

    def shape(c):
        return (f"hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']} heads, "
                f"MLP {c['intermediate_size']}, vocab {c['vocab_size']}, tied embeddings, "
                f"context {c['max_position_embeddings']}")

    def opt(c):
        return (f"{c['steps']} steps x {c['batch_size']} x {c['seq_len']} tokens, AdamW (0.9, 0.95), peak lr "
                f"{c['lr']}, {c['warmup_steps']} warmup steps then cosine to {c['min_lr_ratio']} x peak, weight "
                f"decay {c['weight_decay']}, grad clip {c['grad_clip']}, seed {c['seed']}")

    undertrained_note = ""
    if ev["draft_loss"] < ev["target_loss"]:
        undertrained_note = ("\n\nThe draft's held-out loss is below the target's: the target is so undertrained that "
                             "its smoothed copy, also nudged towards the data by the cross-entropy term, generalises "
                             "slightly better to unseen files.")

    def goal(name):
        return "met" if ev[name] >= GOALS[name] else "NOT met"

    lines = f"""# specdecode bundled models: target + draft

A small Llama-architecture model family trained from scratch by specdecode itself, so that speculative decoding
can be shown on real trained models without a model hub. They know Python code (the standard library) and
nothing else: a demonstration pair, not a general-purpose assistant.

| | target | draft |
|---|---|---|
| folder | `target/` | `draft/` |
| parameters | {tg['parameters']:,} | {dr['parameters']:,} ({dr['parameters'] / tg['parameters']:.3f} of the target) |
| shape | {shape(t_cfg)} | {shape(d_cfg)} |
| training | next-token cross-entropy | distilled from the target: {1 - dr['ce_weight']:g} x KL(p_target ‖ q_draft) + {dr['ce_weight']:g} x cross-entropy |
| tokens seen | {tg['tokens_seen']:,} | {dr['tokens_seen']:,} |
| training wall time | {tg['wall_time_s'] / 60:.1f} min | {dr['wall_time_s'] / 60:.1f} min |
| training throughput | {tg['tokens_seen'] / tg['wall_time_s']:.0f} tokens/s | {dr['tokens_seen'] / dr['wall_time_s']:.0f} tokens/s (target forward included) |
| held-out loss (nats/token) | {ev['target_loss']} (perplexity {ev['target_perplexity']}) | {ev['draft_loss']} (perplexity {ev['draft_perplexity']}) |

Format: Hugging Face folders (`config.json`, `model.safetensors` in bfloat16, `tokenizer.json`,
`tokenizer_config.json`, `generation_config.json`); `transformers.AutoModelForCausalLM` and `AutoTokenizer` load
them (tested in tests/train/test_bundled_models.py). All artifacts: {_mb(out_dir):.1f} MB.

## Data

- Corpus: the `*.py` files of the Python standard library of the interpreter that ran the recipe
  (`{corpus}`, found with `sysconfig`), without site-packages; files that are not UTF-8 or exceed 2 MB are skipped.
- Split by file, deterministically: a file is held out when the first 8 bytes of sha256(relative path) / 2^64
  fall below {heldout_fraction}. {tk['train_files']} training files ({tk['train_chars']:,} characters,
  {stages['pretokenize']['train_tokens']:,} tokens), {tk['heldout_files']} held-out files (listed in `heldout.json`).
- Each file is encoded as `<|bos|> text <|eos|>` and the files are concatenated; training batches are random
  windows of that stream (a function of the seed and the step, so a resumed run sees the same batches).

## Tokenizer

Byte-level BPE (the `tokenizers` library), vocabulary {t_cfg['vocab_size']}, trained on the training files.
Special tokens `<|pad|>` (0), `<|bos|>` (1), `<|eos|>` (2). Encoding prepends `<|bos|>` (`add_bos_token: true`;
tokenizer.json's post-processor does the same for transformers); generation stops at `<|eos|>`.

## Recipe

- Target: {opt(tg['config'])}. float32 training, normal(0, 0.02) init (residual projections scaled by 1/sqrt(2 x layers)).
- Draft: {opt(dr['config'])}. The teacher is the exported bfloat16 target (loaded in float32), run without
  gradients on the same batch.
- Hardware: {hardware()}.
- Wall time of the whole recipe: {total_wall / 60:.1f} min (tokenizer {tk['wall_time_s']:.0f} s,
  pre-tokenisation {stages['pretokenize']['wall_time_s']:.0f} s, target {tg['wall_time_s'] / 60:.1f} min,
  draft {dr['wall_time_s'] / 60:.1f} min, evaluation {ev['wall_time_s'] / 60:.1f} min).
  Wall times are as measured; a machine shared with other jobs makes them longer than an idle one would.

Reproduce every artifact here (checkpoints and logs go to `runs/recipe/`; after an interruption, run the same
command with `--resume` to continue from the last checkpoint):

    {command or 'specdecode train all --out specdecode/catalog'}

## Evaluation (held-out files)

Measured by the recipe's last stage; `specdecode eval` repeats it on the bundled models.

| figure | value | goal |
|---|---|---|
| target held-out loss / perplexity | {ev['target_loss']} / {ev['target_perplexity']} | |
| draft held-out loss / perplexity | {ev['draft_loss']} / {ev['draft_perplexity']} | |
| greedy agreement (draft argmax = target argmax along the target's greedy continuations) | {ev['greedy_agreement']} | >= {GOALS['greedy_agreement']} ({goal('greedy_agreement')}) |
| expected acceptance at temperature 1, mean sum_x min(p, q), on held-out text | {ev['acceptance_t1']} | >= {GOALS['acceptance_t1']} ({goal('acceptance_t1')}) |
| expected acceptance at temperature 1 along the greedy continuations | {ev['acceptance_t1_on_greedy']} | |
| argmax agreement on held-out text (teacher forcing) | {ev['greedy_agreement_on_text']} | |

Loss and acceptance are over {ev['scored_positions']:,} positions: evenly spaced windows of the held-out token
stream ({ev['heldout_tokens']:,} tokens). Greedy agreement: {ev['greedy_prompts']} prompts of
{ev['greedy_prompt_len']} held-out tokens, {ev['greedy_new_tokens']} greedy target tokens each.

## Limitations

Tiny models trained for {total_wall / 60:.0f} minutes on a small CPU, far from converged (held-out perplexity
{ev['target_perplexity']:.0f}). Their text is Python-flavoured but mostly ungrammatical, and greedy decoding soon falls
into repetition loops, which also makes greedy agreement with the draft easy. They exist to show speculative
decoding working, losslessly, on real trained weights; not to write code. The trained context is
{t_cfg['max_position_embeddings']} tokens.{undertrained_note}
"""
    (out_dir / "MODEL_CARD.md").write_text(lines)
