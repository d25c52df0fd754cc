"""Rank 0's side of a tensor-parallel model: the engine holds a ParallelModel as if it were the model.

Every target forward and every KV-cache commit is first broadcast as a Command, so that the other ranks run the
same operation on their shard; the all-reduces inside the layers then line up. Everything else (scheduling,
the proposer, sampling, verification) runs on rank 0 only, and no token ever needs to travel back: after the
last all-reduce rank 0 holds the full hidden states and the (replicated) LM head.
"""
from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import torch

from specdecode.model.cache import KVCache


@dataclasses.dataclass
class Command:
    """One operation for the worker ranks."""

    op: str
    """'forward', 'make_cache', 'commit' or 'stop'."""
    model: str = "target"
    """Which of the worker's models."""
    cache_id: int | None = None
    """The cache the operation uses (ids are rank 0's)."""
    args: dict = dataclasses.field(default_factory=dict)
    """The operation's arguments (tensors as numpy arrays, see to_wire)."""
    lengths: np.ndarray | None = None
    """The cache's committed lengths [slots] on rank 0 just before the operation (workers copy them)."""
    freed: list[int] = dataclasses.field(default_factory=list)
    """Caches rank 0 has dropped since the last command: the workers drop theirs."""


def to_wire(value):
    """A tensor as a numpy array (pickled in microseconds, a torch tensor takes hundreds); other values as they are.
    bfloat16 has no numpy type: such tensors travel as torch tensors."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach().cpu()
    return value if value.dtype == torch.bfloat16 else value.numpy()


def from_wire(value, device: torch.device | None = None):
    """Inverse of to_wire (onto device, if given)."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    return value.to(device) if isinstance(value, torch.Tensor) and device is not None else value


class ParallelCache:
    """Rank 0's KVCache of a tensor-parallel model (its KV heads only). Lengths change locally (reset, advance,
    rollback, direct writes) and travel with the next command; a commit moves cache entries, so it is broadcast."""

    def __init__(self, local: KVCache, cache_id: int, runtime):
        self.local, self.cache_id, self.runtime = local, cache_id, runtime
        weakref.finalize(self, runtime.freed.append, cache_id)

    def __getattr__(self, name):
        return getattr(self.local, name)

    def commit(self, slots: torch.Tensor, kept: torch.Tensor, n_kept: torch.Tensor) -> None:
        args = {"slots": to_wire(slots), "kept": to_wire(kept), "n_kept": to_wire(n_kept)}
        self.runtime.send(Command("commit", cache_id=self.cache_id, args=args, lengths=to_wire(self.local.lengths)))
        self.local.commit(slots, kept, n_kept)


class ParallelModel:
    """Rank 0's shard of a tensor-parallel LlamaForCausalLM, called as the model itself (other attributes are
    the shard's: config, device, embeddings and LM head, which every rank holds whole)."""

    def __init__(self, name: str, local, runtime, unsharded_digest: str | None = None):
        self.name, self.local, self.runtime = name, local, runtime
        self.unsharded_digest = unsharded_digest
        """weights_digest of the whole model (speculators check it): the shard's own would name other weights."""

    def __getattr__(self, name):
        return getattr(self.local, name)

    def make_cache(self, slots: int, max_len: int) -> ParallelCache:
        cache_id = next(self.runtime.cache_ids)
        self.runtime.send(Command("make_cache", self.name, cache_id, {"slots": slots, "max_len": max_len}))
        return ParallelCache(self.local.make_cache(slots, max_len), cache_id, self.runtime)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                 cache: ParallelCache | None = None, slots: torch.Tensor | None = None,
                 tree_mask: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                 compute_logits: bool = True, inputs_embeds: torch.Tensor | None = None, pending: int = 0,
                 chunk: tuple[int, list[int]] | None = None):
        """LlamaForCausalLM.forward on every rank; returns rank 0's output (the whole model's). A chunk of another
        row's prompt runs first, as a forward of its own on every rank."""
        if chunk is not None:
            self(torch.tensor([chunk[1]]), cache=cache, slots=torch.tensor([chunk[0]]), compute_logits=False)
        args = {"input_ids": input_ids, "positions": positions, "slots": slots, "tree_mask": tree_mask,
                "inputs_embeds": inputs_embeds, "pending": pending}
        self.runtime.send(Command("forward", self.name, None if cache is None else cache.cache_id,
                                  {k: to_wire(v) for k, v in args.items()},
                                  None if cache is None else to_wire(cache.local.lengths)))
        return self.local(input_ids, positions, None if cache is None else cache.local, slots, tree_mask,
                          hidden_layers, compute_logits, inputs_embeds, pending)

    forward = __call__
