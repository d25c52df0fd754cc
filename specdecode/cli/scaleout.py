"""Command-line flags for tensor parallelism, memory budgets (`generate`, `serve`) and Ray Serve replicas (`serve`);
no torch imports here: the command line starts fast."""
from __future__ import annotations

from specdecode.cli.types import GIB, PROBABILITY, float_range, int_range
from specdecode.plan import GiB


def add_scaleout_args(p) -> None:
    """--tensor-parallel-size, --draft-tensor-parallel-size, --memory-budget, --gpu-memory-utilization (generate,
    serve)."""
    group = p.add_argument_group("scale-out and memory")
    group.add_argument("--tensor-parallel-size", type=int_range(1, 1024), default=1,
                       help="shard the target's heads and MLP over N processes (gloo on CPU, NCCL on N GPUs)")
    group.add_argument("--draft-tensor-parallel-size", type=int_range(1, 1), default=None,
                       help="1 (default): the draft model or heads run whole on rank 0")
    group.add_argument("--memory-budget", type=GIB, default=None, metavar="GiB",
                       help="memory per rank to plan for (CPU): the batch is sized to fit, start-up refuses "
                            "what cannot (see `specdecode plan`)")
    group.add_argument("--gpu-memory-utilization", type=PROBABILITY, default=None,
                       help="fraction of each CUDA device's memory to plan for (as --memory-budget)")


def scaleout_kwargs(args) -> dict:
    """LLM keyword arguments from add_scaleout_args' flags."""
    return {"tensor_parallel_size": args.tensor_parallel_size,
            "draft_tensor_parallel_size": args.draft_tensor_parallel_size,
            "memory_budget": None if args.memory_budget is None else int(args.memory_budget * GiB),
            "gpu_memory_utilization": args.gpu_memory_utilization}


def add_replica_args(p) -> None:
    """Ray Serve replicas of `serve` (the [ray] extra)."""
    group = p.add_argument_group("replicas on Ray Serve (pip install -e '.[ray]')")
    group.add_argument("--replicas", type=int_range(1, 1024), default=None,
                       help="serve N replicas of the engine behind Ray Serve's HTTP proxy (same routes)")
    group.add_argument("--min-replicas", type=int_range(0, 1024), default=None, help="autoscale between this ...")
    group.add_argument("--max-replicas", type=int_range(1, 1024), default=None, help="... and this many replicas")
    group.add_argument("--replica-cpus", type=float_range(0.0, 4096.0), default=1.0,
                       help="CPUs Ray reserves per replica (default 1)")
    group.add_argument("--replica-gpus", type=float_range(0.0, 64.0), default=0.0,
                       help="GPUs per replica (default 0; its --tensor-parallel-size on GPUs)")
    group.add_argument("--graceful-shutdown-timeout", type=float_range(0.0, 86400.0), default=30.0,
                       help="seconds a stopping replica may finish its requests (default 30)")
    group.add_argument("--ray-address", default=None,
                       help="Ray cluster to join (default: RAY_ADDRESS, else a local one started here)")
