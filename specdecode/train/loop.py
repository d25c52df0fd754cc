"""The training loop shared by pretraining and distillation: AdamW, warmup + cosine schedule, gradient
clipping, a progress bar, JSON-lines loss log, periodic checkpoints and exact resume.

Batches are a function of (seed, step) and the checkpoint holds the model, the optimizer and the step, so a run
resumed from a checkpoint takes exactly the steps the uninterrupted run would have taken.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from specdecode.errors import ConfigError
from specdecode.train.data import sample_windows

if TYPE_CHECKING:  # torch is imported where it is used: `specdecode --help` reads TrainConfig's defaults
    import numpy as np
    import torch


@dataclasses.dataclass
class TrainConfig:
    """Optimisation settings of one training stage."""

    steps: int = 1000
    """Number of optimizer steps."""
    batch_size: int = 8
    """Sequences per step."""
    seq_len: int = 256
    """Tokens per sequence."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_steps: int = 50
    """Linear warmup from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW weight decay (matrices only; norms and embeddings are not decayed)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    seed: int = 0
    """Seeds the initialisation and the batch sampling."""
    checkpoint_every: int = 50
    """Steps between checkpoints."""
    log_every: int = 10
    """Steps between log lines."""

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every", "log_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"warmup_steps must be in [0, steps], got {self.warmup_steps}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    import torch

    decay, no_decay = [], []
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def checkpoint_path(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoint.pt"


def _frozen_names(model) -> set[str]:
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def save_checkpoint(run_dir: Path, model, optimizer, state: dict) -> None:
    """The trained weights (frozen ones, such as a head's copy of the target's embedding, are rebuilt from the
    target and left out), the optimizer and the position, written atomically."""
    import torch

    path = checkpoint_path(run_dir)
    tmp = path.with_suffix(".tmp")
    frozen = _frozen_names(model)
    weights = {k: v for k, v in model.state_dict().items() if k not in frozen}
    torch.save({"model": weights, "optimizer": optimizer.state_dict(), **state}, tmp)
    tmp.replace(path)  # atomic: an interruption never leaves a half-written checkpoint


def load_weights(model, weights: dict) -> None:
    """Load a checkpoint's weights: every trained one must be there; frozen ones may be missing."""
    result = model.load_state_dict(weights, strict=False)
    missing = set(result.missing_keys) - _frozen_names(model)
    if missing or result.unexpected_keys:
        raise ConfigError(f"the checkpoint does not fit this model (missing {sorted(missing)[:3]}, unexpected "
                          f"{result.unexpected_keys[:3]}): resume with the settings it was made with")


LossFn = Callable[["torch.nn.Module", object], "tuple[torch.Tensor, dict]"]
"""loss_fn(model, batch) -> (loss to minimise, extra floats to log; "tokens" = tokens in the batch)."""


def train(model: torch.nn.Module, loss_fn: LossFn, tokens: "np.ndarray | Callable[[int], object]",
          cfg: TrainConfig, run_dir: Path, resume: bool = False, desc: str = "train") -> dict:
    """Run (or finish) a training stage; return its summary (steps, tokens seen, wall time, last losses).

    tokens: a token array (batches are random windows of it, [B, T+1]) or batch_at(step) -> batch, which must
    be a function of the step only, so that resuming sees the same batches."""
    import numpy as np
    import torch
    from tqdm import tqdm

    if isinstance(tokens, np.ndarray):
        corpus = tokens

        def batch_at(step):
            return torch.from_numpy(sample_windows(corpus, cfg.batch_size, cfg.seq_len, cfg.seed, step))
    else:
        batch_at = tokens
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    optimizer = make_optimizer(model, cfg)
    state = {"step": 0, "tokens_seen": 0, "wall_time_s": 0.0, "train_config": dataclasses.asdict(cfg)}
    log_path = run_dir / "log.jsonl"
    if resume and checkpoint_path(run_dir).is_file():
        ckpt = torch.load(checkpoint_path(run_dir), map_location="cpu", weights_only=False)
        load_weights(model, ckpt.pop("model"))
        optimizer.load_state_dict(ckpt.pop("optimizer"))
        state.update({k: ckpt[k] for k in ("step", "tokens_seen", "wall_time_s")})
        if ckpt["train_config"] != dataclasses.asdict(cfg):
            raise ConfigError(f"the checkpoint in {run_dir} was made with different settings "
                              f"({ckpt['train_config']}); resume with the same ones or use a new run folder")
        if log_path.exists():  # drop what was logged after the checkpoint: those steps are taken again
            kept = [line for line in log_path.read_text().splitlines()
                    if line and json.loads(line)["step"] <= state["step"]]
            log_path.write_text("".join(line + "\n" for line in kept))
    elif log_path.exists():
        log_path.unlink()
    model.train()
    started, wall_before = time.time(), state["wall_time_s"]
    bar = tqdm(total=cfg.steps, initial=state["step"], desc=desc, unit="step", dynamic_ncols=True)
    recent = []
    with open(log_path, "a") as log:
        while state["step"] < cfg.steps:
            step = state["step"]
            lr = cfg.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss, extra = loss_fn(model, batch_at(step))
            batch_tokens = extra.pop("tokens", cfg.batch_size * cfg.seq_len)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            state["step"] = step + 1
            state["tokens_seen"] += int(batch_tokens)
            state["wall_time_s"] = wall_before + time.time() - started
            recent.append(loss.item())
            bar.update(1)
            if state["step"] % cfg.log_every == 0 or state["step"] == cfg.steps:
                mean_loss = sum(recent) / len(recent)
                recent = []
                record = {"step": state["step"], "loss": round(mean_loss, 5), "lr": lr,
                          "grad_norm": round(float(grad_norm), 4), "tokens_seen": state["tokens_seen"],
                          "wall_time_s": round(state["wall_time_s"], 1),
                          **{k: round(float(v), 5) for k, v in extra.items()}}
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.2e}")
            if state["step"] % cfg.checkpoint_every == 0 or state["step"] == cfg.steps:
                save_checkpoint(run_dir, model, optimizer, state)
    bar.close()
    model.eval()
    return {k: state[k] for k in ("step", "tokens_seen", "wall_time_s")}
