"""The collectives one tensor-parallel group uses, on a process group object of its own.

No torch.distributed default group is created: a process can hold several engines (tests do), and nothing
global says which group a tensor belongs to. gloo carries CPU tensors, NCCL CUDA ones.
"""
from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

from specdecode.errors import ConfigError

IDLE_TIMEOUT = datetime.timedelta(days=30)
"""How long a collective may wait: workers wait for the engine's next command, and a server may idle for long.
A dead engine is noticed by the worker's parent watch (worker.py), not by this timeout."""


class Group:
    """All-reduce and object broadcast (rank 0 -> all) over `world_size` processes that share `store`."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, device
        if device.type == "cuda":
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise ConfigError("tensor parallelism on CUDA needs a torch build with NCCL")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = IDLE_TIMEOUT
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, IDLE_TIMEOUT)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; every rank ends with the same values."""
        self.pg.allreduce([tensor]).wait()
        return tensor

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled; tensors inside should be on the CPU)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
            size = torch.tensor([data.numel()], dtype=torch.long, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.long, device=self.device)
        self.pg.broadcast([size]).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.pg.broadcast([data]).wait()
        return obj if self.rank == 0 else pickle.loads(data.cpu().numpy().tobytes())
