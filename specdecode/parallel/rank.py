"""What every rank does, rank 0 in this process and the others in worker processes: join the group through rank
0's store, and load its own shard of the target."""
from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from specdecode.model.digest import weights_digest
from specdecode.model.loading import load_model
from specdecode.parallel.group import Group
from specdecode.parallel.tp import TensorParallel, shard_model


STORE_TIMEOUT = datetime.timedelta(seconds=300)
"""How long ranks wait for each other to reach the rendezvous."""


class GroupHolder:
    """The group the layers' all-reduce hooks use: known only once every rank has loaded its shard."""

    group: Group | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(tensor)

    def connect(self, store: dist.Store, rank: int, world_size: int, device: torch.device) -> Group:
        self.group = Group(dist.PrefixStore("group", store), rank, world_size, device)
        return self.group


def join_group(rank: int, world_size: int, port: int) -> tuple[dist.Store, GroupHolder]:
    """A worker's connection to rank 0's store."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=STORE_TIMEOUT)
    return store, GroupHolder()


def load_shard(model_dir: str | Path, dtype, device, quantization, rank: int, world_size: int,
               holder: GroupHolder) -> tuple:
    """(this rank's shard, the whole model's weights_digest on rank 0 else None)."""
    digest = []

    def shard(model):
        if rank == 0:  # speculators name the whole target's weights
            digest.append(weights_digest(model))
        return shard_model(model, TensorParallel(rank, world_size), holder.all_reduce)

    model = load_model(model_dir, dtype=dtype, device=device, quantization=quantization, shard=shard)
    return model, (digest[0] if digest else None)
