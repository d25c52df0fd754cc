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
INLINE_BYTES = 16 * 1024
"""Size of the one buffer an object broadcast sends first: a decode step's command fits in it."""


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
        """Rank 0's `obj` on every rank (pickled: numpy arrays inside pickle fast, torch tensors slowly). One
        broadcast of a fixed-size buffer carries a small object; a larger one takes a second for the rest."""
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            head = torch.zeros(INLINE_BYTES, dtype=torch.uint8)
            head[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
            inline = min(len(data), INLINE_BYTES - 8)
            head[8:8 + inline] = torch.frombuffer(bytearray(data[:inline]), dtype=torch.uint8)
            head = head.to(self.device)
        else:
            head = torch.empty(INLINE_BYTES, dtype=torch.uint8, device=self.device)
        self.pg.broadcast([head]).wait()
        head = head.cpu().numpy()
        size = int.from_bytes(head[:8].tobytes(), "little")
        if size > INLINE_BYTES - 8:
            rest = (torch.frombuffer(bytearray(data[INLINE_BYTES - 8:]), dtype=torch.uint8).to(self.device)
                    if self.rank == 0 else torch.empty(size - INLINE_BYTES + 8, dtype=torch.uint8, device=self.device))
            self.pg.broadcast([rest]).wait()
            if self.rank != 0:
                return pickle.loads(head[8:].tobytes() + rest.cpu().numpy().tobytes())
        return obj if self.rank == 0 else pickle.loads(head[8:8 + size].tobytes())
