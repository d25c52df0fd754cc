"""`specdecode serve`: the OpenAI-compatible server, speculating adaptively by default."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

from specdecode.cli.model_flags import add_model_args, add_quantization_arg
from specdecode.cli.scaleout import add_replica_args, add_scaleout_args, scaleout_kwargs
from specdecode.model.blocks import BLOCK_SIZE
from specdecode.cli.types import MAX_NUM_SEQS, PORT, POSITIVE, SECONDS, float_range, int_range
from specdecode.errors import ConfigError
from specdecode.server.limits import ServerLimits

API_KEY_ENV = "SPECDECODE_API_KEY"
"""Environment variable read for the API key when neither --api-key nor --api-key-file is given."""
DEFAULT_MAX_NUM_SEQS = 32
"""Most sequences decoded at once when --max-num-seqs is not given (fewer if fewer fit the memory)."""
DEFAULT_MEMORY_FRACTION = 0.25
"""Share of the memory available at start-up, beyond the models' weights, that a CPU server plans for its KV pool
and activations by default: a server shares its machine (a 135M model at 8,192 positions needs ~0.5 GiB per
sequence; 32 of them would take 16 GiB). With default flags, a server whose models and one sequence fit the memory
available starts even where that share is too small (its pool is then one sequence)."""
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""Share of a CUDA device's memory a server plans for by default (vLLM's default)."""


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API with speculative decoding",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
                                   "The engine batches requests continuously and chooses how many tokens to draft "
                                   "each step from measured costs and acceptance rates.")
    add_model_args(p)
    add_quantization_arg(p)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the --model argument, "
                        "or the default model's catalog name, qwen2.5-coder-1.5b-instruct)")
    p.add_argument("--strict-model-name", action="store_true",
                   help="answer 404 to a request naming a model other than the served one, as vLLM does (default: "
                        "serve it with the one model, as llama-server does)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=PORT, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (other users can read a command line: "
                        f"prefer --api-key-file or the {API_KEY_ENV} environment variable)")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="read the API key from this file (surrounding whitespace ignored)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated host names clients may address the server by, besides the --host address, "
                        "localhost, 127.0.0.1 and ::1 (requests with any other Host header get 400, against DNS "
                        "rebinding); '*' allows any")
    p.add_argument("--cors-origins", default=None,
                   help="web pages that may call the server from a browser, as llama-server's flag: '*' (any page), "
                        "'localhost' (pages served from this machine) or comma-separated origins (default: none; "
                        "llama-server's default is '*')")
    p.add_argument("--max-num-seqs", type=MAX_NUM_SEQS, default=None,
                   help=f"sequences decoded at once (default: as many as fit the memory available, at most "
                        f"{DEFAULT_MAX_NUM_SEQS})")
    p.add_argument("--max-waiting", type=int_range(0), default=256,
                   help="requests queued beyond --max-num-seqs before new ones get 503 (default 256)")
    p.add_argument("--max-model-len", type=int_range(2), default=None,
                   help="context length (default: the model's)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the keys and values the cache holds of a new prompt's beginning, from running and "
                        "finished requests: a chat's next turn, a shared system prompt (default on)")
    p.add_argument("--block-size", type=int_range(0, 1024), default=BLOCK_SIZE,
                   help=f"positions per block of the paged KV cache: memory follows the tokens held (default "
                        f"{BLOCK_SIZE}); 0: one preallocated row of --max-model-len per sequence")
    p.add_argument("--num-kv-blocks", type=int_range(1), default=None,
                   help="the paged pool's size in blocks instead of the memory plan's (a small pool preempts: for "
                        "tests and soaks)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "float32", "bfloat16", "float16", "q8_0"), default="auto",
                   help="what the target's keys and values are stored as (default auto: float16 on CPU where the "
                        "quantized kernels run, half of float32's bytes for +0.02%% perplexity; float32 with float "
                        "weights); q8_0: 8 bits a value and a scale per 32, about half of float16's bytes, with "
                        "the quantized kernels only")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill a long prompt that arrives while others decode in chunks between their steps "
                        "(default on)")
    p.add_argument("--memory-fraction", type=float_range(0.0, 1.0, lo_open=True), default=None,
                   help="on a CPU: the share of the memory available now, beyond the models' weights, that the KV "
                        f"pool and activations may take (default {DEFAULT_MEMORY_FRACTION}, or more when only that "
                        "lets one sequence fit)")
    p.add_argument("--disable-by-batch-size", type=POSITIVE, default=None,
                   help="never speculate while this many sequences run")
    p.add_argument("--stall-timeout", type=SECONDS, default=None,
                   help="seconds one engine iteration may take before /health reports the engine stalled "
                        "(default 300)")
    add_limit_args(p)
    add_scaleout_args(p)
    add_replica_args(p)
    p.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    p.set_defaults(func=cmd_serve, compare=False)


def api_key(args, environ=os.environ) -> str | None:
    """The API key from --api-key, --api-key-file or SPECDECODE_API_KEY (None: no key is required)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ConfigError("give the API key with --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            key, source = args.api_key_file.read_text().strip(), f"the file {args.api_key_file}"
        except OSError as exc:
            raise ConfigError(f"cannot read --api-key-file: {exc}") from None
    elif args.api_key is not None:
        key, source = args.api_key.strip(), "--api-key"
    elif environ.get(API_KEY_ENV) is not None:
        key, source = environ[API_KEY_ENV].strip(), API_KEY_ENV
    else:
        return None
    if not key:
        raise ConfigError(f"the API key from {source} is empty, which would lock every client out; give a key, or "
                          "no key option at all to serve without one")
    return key


def allowed_hosts(args) -> list[str]:
    from specdecode.server.guard import LOCAL_HOSTS

    extra = [h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip()]
    if args.host in ("0.0.0.0", "::", "") and not extra:
        logging.getLogger("specdecode.server").warning(
            "bound to every address, but only clients that address the server as localhost are answered; "
            "pass --allowed-hosts with the names clients use (or '*')")
    return [args.host, *LOCAL_HOSTS, *extra]


@dataclasses.dataclass
class Sizing:
    """What the start-up plan found, for the ready line."""

    planned: int | None = None
    """Bytes the process may come to hold: the plan's weights, whole KV pool and activations, plus what Python and
    torch held before the models loaded (None: no plan, nothing known of the memory)."""
    growth: int | None = None
    """Bytes beyond what it holds when idle that it may come to hold: the whole KV pool (its pages are taken as
    blocks are first written, model/cache.py's lazy_zeros) and the activations of the largest pass."""
    available: int | None = None
    """Bytes available at start-up that --memory-fraction took its share of (None: a budget was given)."""


def memory_defaults(args, device) -> int | None:
    """Without --memory-budget or --gpu-memory-utilization on a CPU, returns the bytes available now (size_batch
    plans for the models and a share of what they leave); None when a budget was given or nothing is known."""
    from specdecode.hardware import available_memory

    if args.memory_budget is not None or args.gpu_memory_utilization is not None:
        return None
    if device.type == "cuda":
        args.gpu_memory_utilization = DEFAULT_GPU_MEMORY_UTILIZATION
        return None
    return available_memory()


def resident_bytes() -> int:
    """This process's resident memory now (Python, torch and whatever is loaded); 0 where it cannot be read."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def size_batch(args, model_dir, config) -> Sizing:
    """Set args.max_num_seqs from the capacity plan: as many as fit (at most DEFAULT_MAX_NUM_SEQS) when it was not
    given; a --max-num-seqs or --max-model-len that does not fit is refused here, before the model loads."""
    from specdecode.model.loading import read_config, resolve_device, resolve_quantization
    from specdecode.plan import memory_budget_bytes, plan_memory
    from specdecode.speculation.config import SpeculativeConfig, with_shipped_speculator

    context = read_config(model_dir).max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > context:
        raise ConfigError(f"--max-model-len {args.max_model_len} is longer than the model's context ({context}); "
                          f"lower it to {context} or less")
    device = resolve_device(args.device)
    available = memory_defaults(args, device)
    runtime = resident_bytes()  # Python and torch, before any model loads
    budget = memory_budget_bytes(device, scaleout_kwargs(args)["memory_budget"], args.gpu_memory_utilization)
    wanted = args.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    if budget is None and available is None:  # nothing known of the memory: take the flag or the default as it is
        args.max_num_seqs = wanted
        return Sizing()
    spec = SpeculativeConfig.parse(with_shipped_speculator(config, args.model))
    quantization = resolve_quantization(args.quantization, model_dir, device, args.tensor_parallel_size)
    def plan_for(max_model_len, budget):
        return plan_memory(model_dir, budget, max_model_len, wanted, spec, args.dtype, args.device,
                           args.tensor_parallel_size, quantization=quantization,
                           block_size=(args.block_size or None) if args.tensor_parallel_size == 1 else None,
                           kv_cache_dtype=args.kv_cache_dtype)

    if budget is None:  # a CPU without a budget: the models, and a share of what they leave
        fraction = args.memory_fraction if args.memory_fraction is not None else DEFAULT_MEMORY_FRACTION
        probe = plan_for(args.max_model_len, available)
        weights = probe.target.weights + probe.draft.weights
        budget = int(weights + fraction * max(0, available - weights))
    plan = plan_for(args.max_model_len, budget)
    one_sequence = available is not None and args.memory_fraction is None and args.max_num_seqs is None
    if plan.largest_batch() < 1 and one_sequence and (args.max_model_len is not None or plan.max_model_len <= 2048):
        # default flags: start whenever the models and one sequence fit the memory available
        plan = fit_one_sequence(plan, plan_for, args.max_model_len, available)
    largest = plan.largest_batch()
    while largest < 1 and args.max_model_len is None and plan.max_model_len > 2048:
        # no length asked for, and the model's whole context does not fit one sequence (a 32k-context model's
        # full-length prefill alone holds GBs of activations): serve shorter sequences, and say so
        shorter = plan.max_model_len // 2
        plan = plan_for(shorter, plan.budget)
        if plan.largest_batch() < 1 and one_sequence and shorter <= 2048:
            plan = fit_one_sequence(plan, plan_for, shorter, available)
        largest = plan.largest_batch()
        if largest >= 1:
            print(f"specdecode: serving sequences of up to {shorter} positions (the model's {context} do not fit "
                  "the memory budget; --max-model-len / --memory-fraction change it)", file=sys.stderr, flush=True)
    where = (f"{plan.budget / 2**30:.1f} GiB (--memory-budget / --gpu-memory-utilization)" if available is None
             else f"{plan.budget / 2**30:.1f} GiB ({plan.headroom:.0%} kept free; the models and --memory-fraction of "
                  f"the rest of the {available / 2**30:.1f} GiB available)")
    if largest < 1:
        raise ConfigError(f"not even one sequence of {plan.max_model_len} positions fits {where}: lower "
                          "--max-model-len, or raise --memory-fraction / --memory-budget")
    if args.max_num_seqs is not None and args.max_num_seqs > largest:
        raise ConfigError(f"--max-num-seqs {args.max_num_seqs} at {plan.max_model_len} positions needs "
                          f"{plan.needed() / 2**30:.1f} GiB but the plan has {where}: lower --max-num-seqs to "
                          f"{largest} or --max-model-len, or raise --memory-fraction / --memory-budget")
    args.max_num_seqs = min(wanted, largest)
    args.max_model_len = plan.max_model_len
    if available is not None:  # the engine allocates the budget planned here
        args.memory_budget = plan.budget / 2**30
    return Sizing(plan.planned() + runtime, growth=plan.kv() + plan.activations(), available=available)


def fit_one_sequence(plan, plan_for, max_model_len: int, available: int):
    """The plan of a budget just large enough for the models and one sequence of max_model_len (the pool then holds
    one sequence), when the memory available has room for it; else `plan` as it was."""
    needed = int(plan.needed() / (1 - plan.headroom)) + plan.block_size * plan.kv_per_position() * 2 \
        if plan.block_size else int(plan.needed(1) / (1 - plan.headroom))
    if needed > available:
        return plan
    return plan_for(max_model_len, needed)


def configuration_line(llm, name: str, sizing: Sizing) -> str:
    """The one line `serve` prints when it is ready: what it runs, and on how much memory."""
    import torch

    config = llm.spec_config
    if config is None:
        spec = "speculation off"
    else:
        k = config.num_speculative_tokens
        spec = f"speculation {config.method} {'adaptive K<=' if config.adaptive else 'K='}{k}"
    threads = torch.get_num_threads()
    memory = ""
    if sizing.planned is not None:
        if sizing.growth is None:
            memory = f", {sizing.planned / 2**30:.2f} GiB planned (models, KV pool, activations, runtime)"
        else:  # what it holds now (the models and the runtime), and what the pool and a long prefill may add
            idle = resident_bytes()
            memory = (f", {idle / 2**30:.2f} GiB resident, up to {(idle + sizing.growth) / 2**30:.2f} GiB planned "
                      "as the KV pool fills")
        if sizing.available is not None:
            memory += f" of {sizing.available / 2**30:.1f} GiB available"
    from specdecode.model.quant import quantized_format

    dtype = str(llm.target.dtype).removeprefix("torch.")
    weights = quantized_format(llm.target)
    if weights is not None:
        dtype = f"{weights} weights, {dtype} activations"
    cache = llm.runner.cache
    if cache is not None and getattr(cache, "paged", False):
        sizes = (f"up to {llm.max_num_seqs} sequences of up to {llm.max_model_len} positions in a KV pool of "
                 f"{cache.num_blocks * cache.block_size:,} positions (blocks of {cache.block_size})")
    else:
        sizes = f"{llm.max_num_seqs} sequences x {llm.max_model_len} positions"
    return (f"{name}: {dtype} on {llm.device}, {threads} thread{'s' if threads > 1 else ''}, {sizes}, "
            f"{spec}{memory}")


def cmd_serve(args) -> int:
    from specdecode.engine.async_engine import STALL_TIMEOUT, AsyncEngine
    from specdecode.cli.model_flags import resolve_models, set_threads
    from specdecode.engine.llm import LLM
    from specdecode.server.app import build_app
    from specdecode.server.transport import uvicorn_options

    key = api_key(args)
    set_threads(args.threads)
    model_dir, config, model_name = resolve_models(args)
    if config is not None:
        config["adaptive"] = args.adaptive
        if args.disable_by_batch_size is not None:
            config["disable_by_batch_size"] = args.disable_by_batch_size
    replicas = args.replicas is not None or args.min_replicas is not None
    sizing = Sizing() if replicas else size_batch(args, model_dir, config)
    if args.max_connections is None:
        args.max_connections = (args.max_num_seqs or DEFAULT_MAX_NUM_SEQS) + args.max_waiting + 64
    limits = limits_from_args(args)
    llm_kwargs = dict(model=model_dir, dtype=args.dtype, device=args.device, speculative_config=config,
                      quantization=args.quantization,
                      max_num_seqs=args.max_num_seqs or DEFAULT_MAX_NUM_SEQS, max_model_len=args.max_model_len,
                      enable_prefix_caching=args.enable_prefix_caching,
                      enable_chunked_prefill=args.enable_chunked_prefill, block_size=args.block_size or None,
                      kv_cache_dtype=args.kv_cache_dtype, num_kv_blocks=args.num_kv_blocks,
                      **scaleout_kwargs(args))
    name = args.served_model_name or model_name
    if replicas:  # Ray Serve: each replica builds its engine
        from specdecode.server.ray_serve import ReplicaSettings, deployment_settings, serve_replicas

        llm_kwargs["model"] = args.model  # a name (None: the default) is fetched by each replica, on its node
        settings = ReplicaSettings(llm_kwargs, name, args.max_waiting, args.stall_timeout or STALL_TIMEOUT, key,
                                   limits, allowed_hosts(args), args.strict_model_name, args.cors_origins)
        return serve_replicas(settings, deployment_settings(args), args.host, args.port, args.ray_address)
    llm = LLM(**llm_kwargs)
    engine = AsyncEngine(llm, max_waiting=args.max_waiting, stall_timeout=args.stall_timeout or STALL_TIMEOUT)
    app = build_app(engine, name, api_key=key, limits=limits, allowed_hosts=allowed_hosts(args),
                    strict_model_name=args.strict_model_name, cors_origins=args.cors_origins)
    engine.start()
    try:
        run_uvicorn(app, args.host, args.port, args.log_level, ready_line=configuration_line(llm, name, sizing),
                    **uvicorn_options(limits))
    finally:
        engine.shutdown()
    return 0


def run_uvicorn(app, host: str, port: int, log_level: str, ready_line: str = "", **options) -> None:
    """Serve app until stopped; once the socket listens, print ready_line and the URL (port 0: the one chosen)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started and self.servers and self.servers[0].sockets:
                bound = self.servers[0].sockets[0].getsockname()[1]
                url = f"http://{f'[{host}]' if ':' in host else host}:{bound}"
                print(f"specdecode serve: {ready_line}; ready at {url}", flush=True)

    Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, **options)).run()


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    d = ServerLimits()
    g = parser.add_argument_group("request and connection limits (beyond them a request gets a 4xx, before any work)")
    g.add_argument("--max-body-bytes", type=int_range(1024, 2**31), default=d.max_body_bytes,
                   help=f"largest request body (default {d.max_body_bytes}: 1 MiB)")
    g.add_argument("--max-messages", type=int_range(1, 100_000), default=d.max_messages,
                   help=f"most messages in one chat request (default {d.max_messages})")
    g.add_argument("--max-prompt-tokens", type=int_range(1), default=None,
                   help="longest prompt in tokens (default: the context length minus one)")
    g.add_argument("--max-stop-strings", type=int_range(0, 1024), default=d.max_stop_strings,
                   help=f"most stop strings per request (default {d.max_stop_strings})")
    g.add_argument("--max-stop-chars", type=int_range(1, 65536), default=d.max_stop_chars,
                   help=f"longest stop string in characters (default {d.max_stop_chars})")
    g.add_argument("--body-timeout", type=float_range(0.0, 86400.0, lo_open=True), default=d.body_timeout,
                   help=f"seconds to receive a request body before answering 408 (default {d.body_timeout:g})")
    g.add_argument("--header-timeout", type=float_range(0.0, 86400.0, lo_open=True), default=d.header_timeout,
                   help=f"seconds to receive a request's headers before closing the connection "
                        f"(default {d.header_timeout:g})")
    g.add_argument("--keep-alive-timeout", type=int_range(0, 86400), default=d.keep_alive_timeout,
                   help=f"seconds an idle keep-alive connection stays open (default {d.keep_alive_timeout})")
    g.add_argument("--max-header-bytes", type=int_range(1024, 2**24), default=d.max_header_bytes,
                   help=f"largest request line plus headers (default {d.max_header_bytes})")
    g.add_argument("--max-connections", type=int_range(1, 1_000_000), default=None,
                   help="connections and requests in progress before new ones get 503 (default: --max-num-seqs + "
                        "--max-waiting + 64)")


def limits_from_args(args) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})
