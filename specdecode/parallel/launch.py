"""Start a tensor-parallel model: N-1 worker processes (fresh interpreters, see worker.py) and rank 0 in this process, each loading its
shard, joined by one process group (gloo on CPU, NCCL on CUDA with one device per rank).

    target = launch_tensor_parallel(model_dir, size=2, dtype="float32", device="cpu")  # a ParallelModel
    ...
    target.runtime.close()  # or let it be collected: the workers stop with it
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from specdecode.parallel.driver import Command, ParallelModel
from specdecode.parallel.group import Group
from specdecode.parallel.tp import check_divisible
from specdecode.parallel.rank import STORE_TIMEOUT, GroupHolder, load_shard
from specdecode.parallel.worker import WorkerSpec
from specdecode.errors import ConfigError
from specdecode.model.loading import read_config, resolve_device, resolve_dtype


class TensorParallelRuntime:
    """Rank 0's handle on the group: sends commands, stops the workers."""

    def __init__(self, group: Group, processes: list):
        self.group, self.processes = group, processes
        self.cache_ids = itertools.count()
        self.freed: list[int] = []  # caches collected since the last command
        self.closed = False

    def send(self, cmd: Command) -> None:
        if self.closed:
            raise RuntimeError("this tensor-parallel model was closed")
        cmd.freed, self.freed = self.freed, []
        self.group.broadcast_object(cmd)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self.closed:
            return
        try:
            self.send(Command("stop"))
        except Exception:  # noqa: BLE001 - a dead worker: terminate below
            pass
        self.closed = True
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


def _rank_devices(device: torch.device, size: int) -> list[str]:
    if device.type == "cpu":
        return ["cpu"] * size
    if device.type != "cuda":
        raise ConfigError(f"tensor parallelism runs on CPU (gloo) or CUDA (NCCL), not {device.type}")
    first = device.index or 0
    if torch.cuda.device_count() < first + size:
        raise ConfigError(f"tensor_parallel_size={size} needs {size} CUDA devices from cuda:{first}; "
                          f"this machine has {torch.cuda.device_count()}")
    return [f"cuda:{first + r}" for r in range(size)]


def _wait_loaded(store: dist.Store, processes: list) -> None:
    """Wait for every worker's shard; raise a worker's error (or its death) here, not as a hang later."""
    pending = {rank: p for rank, p in enumerate(processes, start=1)}
    deadline = time.monotonic() + 3600
    while pending and time.monotonic() < deadline:
        for rank, process in list(pending.items()):
            if store.check([f"loaded/{rank}"]):
                status = store.get(f"loaded/{rank}").decode()
                if status != "ok":
                    raise ConfigError(f"tensor-parallel rank {rank} failed to load its shard:\n{status}")
                del pending[rank]
            elif process.poll() is not None:
                raise ConfigError(f"tensor-parallel rank {rank} exited (code {process.returncode}) while loading")
        time.sleep(0.05)
    if pending:
        raise ConfigError(f"tensor-parallel ranks {sorted(pending)} did not load their shards within an hour")


def launch_tensor_parallel(model_dir: str | Path, size: int, dtype: str | torch.dtype = "auto",
                           device: str | torch.device | None = None,
                           quantization: str | None = None) -> ParallelModel:
    """The target sharded over `size` ranks; this process is rank 0 and the engine's."""
    check_divisible(read_config(model_dir), size)  # before starting anything
    device = resolve_device(device)
    devices = _rank_devices(device, size)
    dtype_name = str(resolve_dtype(dtype, device)).removeprefix("torch.")
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    processes = []
    for rank in range(1, size):
        spec = WorkerSpec(rank, size, store.port, str(model_dir), dtype_name, devices[rank], quantization,
                          torch.get_num_threads())
        processes.append(subprocess.Popen([sys.executable, "-m", "specdecode.parallel.worker",
                                           json.dumps(dataclasses.asdict(spec)), str(os.getpid())]))
    try:
        holder = GroupHolder()
        model, digest = load_shard(model_dir, dtype_name, devices[0], quantization, 0, size, holder)
        _wait_loaded(store, processes)
        runtime = TensorParallelRuntime(holder.connect(store, 0, size, torch.device(devices[0])), processes)
    except BaseException:
        for process in processes:
            process.kill()
        raise
    parallel = ParallelModel("target", model, runtime, digest)
    weakref.finalize(parallel, runtime.close)
    runtime.store = store  # the workers' rendezvous: kept alive with the group
    return parallel
