"""A tiny target whose next-token distributions are peaked like a real model's, a draft that agrees with it often
but is overconfident (as small drafts are), and a proposer of one-hot trees (the kind EAGLE and Medusa verify)."""
from __future__ import annotations

from pathlib import Path

import torch

from specdecode.model.loading import load_model, save_model
from specdecode.speculation.proposers.draft_model import DraftModelProposer
from specdecode.speculation.tree import DraftTree

from tests.conftest import make_checkpoint, write_tokenizer


def sharpen(folder: Path, factor: float, noise: float = 0.0, out: Path | None = None, seed: int = 0) -> None:
    """Multiply a checkpoint's logits by `factor` (through its final norm), optionally adding weight noise."""
    model = load_model(folder, dtype=torch.float32, device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(factor)
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    out = out or folder
    save_model(model, out, dtype=torch.float32)
    if out != folder:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            (out / name).write_bytes((folder / name).read_bytes())


def make_pair(root: Path, target_sharpness: float = 3.0, draft_sharpness: float = 1.5, noise: float = 0.01) -> Path:
    write_tokenizer(root / "tok")
    make_checkpoint(root / "target", root / "tok", seed=0, layers=2)
    sharpen(root / "target", target_sharpness)
    sharpen(root / "target", draft_sharpness, noise, out=root / "draft")
    return root


class OneHotTrees(DraftModelProposer):
    """The draft model's top num_drafts tokens at the root, each continued greedily, as one-hot guesses (no q) for
    every request, sampled ones too."""

    def propose(self, seqs, budgets):
        rows = [i for i, b in enumerate(budgets) if b > 0]
        trees = [DraftTree.empty() for _ in seqs]
        if rows:
            drafted = self._draft([seqs[i] for i in rows], [budgets[i] for i in rows], greedy=True,
                                  prefixes=[[] for _ in rows])
            for i, tree in zip(rows, drafted):
                trees[i] = tree
        return trees
