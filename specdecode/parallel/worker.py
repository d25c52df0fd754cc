"""A worker rank (1..N-1) of a tensor-parallel model: load its shard, then run rank 0's commands until 'stop'.

Started as `python -m specdecode.parallel.worker SPEC_JSON PARENT_PID` (a fresh interpreter: unlike multiprocessing's
spawn, it never re-runs the user's main script).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
import traceback

import torch

from specdecode.parallel.driver import Command, from_wire


@dataclasses.dataclass
class WorkerSpec:
    """What a worker process needs to join its group and load its shard."""

    rank: int
    """This worker's rank (>= 1)."""
    world_size: int
    """Ranks in the group."""
    port: int
    """Port of rank 0's TCPStore on 127.0.0.1."""
    model_dir: str
    """The target checkpoint."""
    dtype: str
    """Weight dtype name, as load_model takes it (already resolved by rank 0)."""
    device: str
    """This rank's device ('cpu' or 'cuda:RANK')."""
    quantization: str | None
    """As load_model takes it."""
    num_threads: int
    """torch intra-op threads (rank 0's)."""


def _watch_parent(parent: int) -> None:
    """Exit when the engine's process is gone (a worker blocked in a collective would otherwise wait forever)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def worker_main(spec: WorkerSpec, parent: int) -> None:
    """Entry point of a worker process."""
    from specdecode.parallel.rank import join_group, load_shard

    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(spec.num_threads)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))
    store, holder = join_group(spec.rank, spec.world_size, spec.port)
    try:
        model = load_shard(spec.model_dir, spec.dtype, spec.device, spec.quantization, spec.rank, spec.world_size,
                           holder)[0]
        store.set(f"loaded/{spec.rank}", "ok")
    except BaseException:  # rank 0 raises it, with this text
        store.set(f"loaded/{spec.rank}", traceback.format_exc())
        return
    group = holder.connect(store, spec.rank, spec.world_size, torch.device(spec.device))
    try:
        run_commands(group, {"target": model}, torch.device(spec.device))
    except RuntimeError as exc:  # gloo/NCCL: rank 0 is gone (killed, crashed); nothing is left to serve
        print(f"specdecode tensor-parallel rank {spec.rank}: the group broke ({str(exc).splitlines()[0][:200]})",
              file=sys.stderr)
        os._exit(1)


@torch.inference_mode()
def run_commands(group, models: dict, device: torch.device) -> None:
    """Follow rank 0: every forward and cache operation it broadcasts, on this rank's shard."""
    caches = {}
    while True:
        cmd: Command = group.broadcast_object()
        for cache_id in cmd.freed:
            caches.pop(cache_id, None)
        if cmd.op == "stop":
            return
        if cmd.op == "make_cache":
            caches[cmd.cache_id] = models[cmd.model].make_cache(cmd.args["slots"], cmd.args["max_len"])
            continue
        cache = caches.get(cmd.cache_id)
        if cache is not None:
            cache.lengths.copy_(from_wire(cmd.lengths))
        if cmd.op == "commit":
            cache.commit(*(from_wire(cmd.args[k]) for k in ("slots", "kept", "n_kept")))
        elif cmd.op == "forward":
            args = {k: from_wire(v, None if k == "slots" else device) for k, v in cmd.args.items()}
            # Only the all-reduces matter here: no logits, no hidden states kept.
            models[cmd.model](cache=cache, compute_logits=False, **args)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {cmd.op!r}")


if __name__ == "__main__":
    worker_main(WorkerSpec(**json.loads(sys.argv[1])), int(sys.argv[2]))
