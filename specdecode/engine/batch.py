"""One step's ragged batch: built once from the proposers' trees, handed to the target pass and the verifier."""
from __future__ import annotations

import dataclasses
import functools

import torch

from specdecode.speculation.tree import DraftTree, tree_shape


@functools.lru_cache(maxsize=4096)
def verify_layout(parents: tuple[int, ...], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask [width, width] and position offsets [width] of [root, nodes..., padding] for one tree."""
    n = len(parents)
    mask = torch.zeros(width, width, dtype=torch.bool)
    mask[:, 0] = True  # everyone sees the root (padding too: its output is never read)
    mask[1:n + 1, 1:n + 1] = tree_shape(parents).attention_mask
    mask[range(width), range(width)] = True
    offsets = torch.ones(width, dtype=torch.long)
    offsets[0] = 0
    offsets[1:n + 1] += tree_shape(parents).depths
    return mask, offsets


@dataclasses.dataclass
class StepBatch:
    """Row b of the target pass is [pending token of sequence b, its tree's pass tokens (drafts, then any
    lookahead branch), padding]; W = 1 + the largest tree."""

    trees: list[DraftTree]
    """Each sequence's draft tree (empty: no draft this step)."""
    slots: torch.Tensor
    """[B] the sequences' cache rows."""
    ids: torch.Tensor
    """[B, W] token ids of the pass (on the target's device)."""
    positions: torch.Tensor | None
    """[B, W] absolute position of every token (committed length + depth); None when W == 1 (plain decoding)."""
    tree_mask: torch.Tensor | None
    """[B, W, W] True where token i may attend to token j of its row; None when W == 1."""

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @classmethod
    def build(cls, pending: list[int], trees: list[DraftTree], slots: list[int], lengths: torch.Tensor,
              device: torch.device) -> "StepBatch":
        """pending [B]: each sequence's last token; lengths: the cache's committed lengths of all its rows."""
        B = len(trees)
        width = 1 + max(t.pass_size for t in trees)  # lookahead branches ride along after the drafts
        slot_ids = torch.tensor(slots)
        ids = torch.zeros(B, width, dtype=torch.long)
        ids[:, 0] = torch.tensor(pending)
        for b, tree in enumerate(trees):
            ids[b, 1:1 + tree.pass_size] = tree.pass_tokens
        positions = tree_mask = None
        if width > 1:
            layouts = [verify_layout(t.pass_parents, width) for t in trees]
            tree_mask = torch.stack([m for m, _ in layouts]).to(device)  # [B, W, W]
            positions = (lengths[slot_ids][:, None] + torch.stack([o for _, o in layouts])).to(device)  # [B, W]
        return cls(trees, slot_ids, ids.to(device), positions, tree_mask)

    def target_inputs(self) -> dict:
        """Keyword arguments of the target's forward for this pass (besides the cache)."""
        inputs = {"slots": self.slots}
        if self.positions is not None:
            inputs.update(positions=self.positions, tree_mask=self.tree_mask)
        return inputs
