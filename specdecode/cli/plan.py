"""`specdecode plan`: print the capacity plan of a serving configuration (see specdecode/plan.py)."""
from __future__ import annotations

from specdecode.cli.types import GIB, MAX_NUM_SEQS, float_range, int_range
from specdecode.model.blocks import BLOCK_SIZE
from specdecode.plan import DEFAULT_HEADROOM, GiB, device_memory, plan_memory


def register(sub) -> None:
    from specdecode.cli.model_flags import add_model_args, add_quantization_arg

    p = sub.add_parser("plan", help="capacity plan: memory of a serving configuration, the largest batch that fits",
                       description="Print the memory per rank of the target, the draft or heads, the KV cache and "
                                   "activations, the headroom left and the largest batch that fits DEVICE_MEMORY; "
                                   "exit with status 1 if the configuration does not fit.")
    add_model_args(p)
    add_quantization_arg(p)
    p.add_argument("--max-model-len", type=int_range(2), default=None,
                   help="positions per sequence (default: the model's)")
    p.add_argument("--max-num-seqs", type=MAX_NUM_SEQS, default=32, help="sequences decoded at once (default 32)")
    p.add_argument("--device-memory", type=GIB, default=None, metavar="GiB",
                   help="memory per device (rank) (default: a CUDA device's total memory; on a CPU, the memory "
                        "available now)")
    p.add_argument("--tensor-parallel-size", type=int_range(1, 1024), default=1,
                   help="ranks the target is sharded over")
    p.add_argument("--block-size", type=int_range(0, 1024), default=BLOCK_SIZE,
                   help=f"positions per block of the paged KV cache (default {BLOCK_SIZE}); 0: one row of "
                        "--max-model-len per sequence (the slots layout)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "float32", "bfloat16", "float16", "q8_0"), default="auto",
                   help="what the target's keys and values are stored as (default auto: float16 on CPU where the "
                        "quantized kernels run, half of float32's bytes for +0.02%% perplexity; float32 with float "
                        "weights); q8_0: 8 bits a value and a scale per 32, with the quantized kernels only")
    p.add_argument("--headroom", type=float_range(0.0, 1.0, hi_open=True), default=DEFAULT_HEADROOM,
                   help=f"fraction of the memory never planned for (default {DEFAULT_HEADROOM})")
    p.set_defaults(func=cmd_plan, compare=False)


def cmd_plan(args) -> int:
    from specdecode.cli.model_flags import resolve_models
    from specdecode.model.loading import resolve_device, resolve_quantization
    from specdecode.speculation.config import SpeculativeConfig

    model_dir, config, name = resolve_models(args)
    device = resolve_device(args.device)
    if args.device_memory is None:
        args.device_memory = device_memory(device) / GiB
    quantization = resolve_quantization(args.quantization, model_dir, device, args.tensor_parallel_size)
    plan = plan_memory(model_dir, int(args.device_memory * GiB), args.max_model_len, args.max_num_seqs,
                       SpeculativeConfig.parse(config), args.dtype, args.device, args.tensor_parallel_size,
                       args.headroom, quantization=quantization,
                       block_size=(args.block_size or None) if args.tensor_parallel_size == 1 else None,
                       kv_cache_dtype=args.kv_cache_dtype)
    method = config["method"] if config else "none"
    print(f"{name}, speculation: {method}, tensor parallel: {args.tensor_parallel_size}, "
          f"{args.device_memory:.4g} GiB per rank")
    print(plan.render())
    if not plan.fits:
        print(f"does not fit: {plan.refusal()}")
        return 1
    return 0
