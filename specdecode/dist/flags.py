"""Command-line flags for tensor parallelism and memory budgets, shared by `generate` and `serve` (no torch
imports here: the command line starts fast)."""
from __future__ import annotations

GiB = 1024 ** 3


def add_scaleout_args(p) -> None:
    """--tensor-parallel-size, --draft-tensor-parallel-size, --memory-budget, --gpu-memory-utilization (generate,
    serve)."""
    group = p.add_argument_group("scale-out and memory")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="shard the target's heads and MLP over N processes (gloo on CPU, NCCL on N GPUs)")
    group.add_argument("--draft-tensor-parallel-size", type=int, default=None,
                       help="1 (default): the draft model or heads run whole on rank 0")
    group.add_argument("--memory-budget", type=float, default=None, metavar="GiB",
                       help="memory per rank to plan for (CPU): the batch is sized to fit, start-up refuses "
                            "what cannot (see `specdecode plan`)")
    group.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="fraction of each CUDA device's memory to plan for (as --memory-budget)")


def scaleout_kwargs(args) -> dict:
    """LLM keyword arguments from add_scaleout_args' flags."""
    return {"tensor_parallel_size": args.tensor_parallel_size,
            "draft_tensor_parallel_size": args.draft_tensor_parallel_size,
            "memory_budget": None if args.memory_budget is None else int(args.memory_budget * GiB),
            "gpu_memory_utilization": args.gpu_memory_utilization}
