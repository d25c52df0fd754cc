"""`specdecode serve`: the OpenAI-compatible server, speculating adaptively by default."""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from specdecode.dist.flags import add_replica_args, add_scaleout_args, scaleout_kwargs
from specdecode.errors import ConfigError
from specdecode.server.limits import add_limit_args, limits_from_args
from specdecode.spec.config import METHODS

API_KEY_ENV = "SPECDECODE_API_KEY"
"""Environment variable read for the API key when neither --api-key nor --api-key-file is given."""


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API with speculative decoding",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
                                   "The engine batches requests continuously and chooses how many tokens to draft "
                                   "each step from measured costs and acceptance rates.")
    p.add_argument("--model", default=None,
                   help="a model name (fetched on first use), a .gguf file, or a Hugging Face checkpoint directory "
                        "(default: smollm2-135m-instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the --model argument, "
                        "or smollm2-135m-instruct for the default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (other users can read a command line: "
                        f"prefer --api-key-file or the {API_KEY_ENV} environment variable)")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="read the API key from this file (surrounding whitespace ignored)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated host names clients may address the server by, besides the --host address, "
                        "localhost, 127.0.0.1 and ::1 (requests with any other Host header get 400, against DNS "
                        "rebinding); '*' allows any")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded at once (default 32)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued beyond --max-num-seqs before new ones get 503 (default 256)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--dtype", default="auto", help="auto (default), float32, bfloat16 or float16")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", choices=METHODS, default=None,
                      help="draft_model (a small model drafts), ngram (prompt lookup), eagle, medusa (heads on the "
                           "target's features), lookahead (Jacobi n-grams) or rest (retrieval from a datastore)")
    spec.add_argument("--speculative-model", type=Path, default=None,
                      help="draft checkpoint, speculator or datastore directory")
    spec.add_argument("--num-speculative-tokens", type=int, default=None,
                      help="most draft tokens per step K (default 5)")
    spec.add_argument("--num-drafts", type=int, default=None, help="draft_model: chains per step (default 1)")
    spec.add_argument("--no-speculation", action="store_true", help="plain decoding")
    spec.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                      help="choose K per step from measured costs (default); --no-adaptive always drafts K")
    spec.add_argument("--disable-by-batch-size", type=int, default=None,
                      help="never speculate while this many sequences run")
    p.add_argument("--stall-timeout", type=float, default=None,
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


def cmd_serve(args) -> int:
    import uvicorn

    from specdecode.engine.async_engine import STALL_TIMEOUT, AsyncEngine
    from specdecode.engine.cli import resolve_models
    from specdecode.engine.llm import LLM
    from specdecode.server.app import build_app
    from specdecode.server.transport import uvicorn_options

    key = api_key(args)
    if args.max_waiting < 0:
        raise ConfigError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.max_connections is None:
        args.max_connections = args.max_num_seqs + args.max_waiting + 64
    limits = limits_from_args(args)
    model_dir, config, model_name = resolve_models(args)
    if config is not None:
        config["adaptive"] = args.adaptive
        if args.disable_by_batch_size is not None:
            config["disable_by_batch_size"] = args.disable_by_batch_size
    llm_kwargs = dict(model=model_dir, dtype=args.dtype, device=args.device, speculative_config=config,
                      max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, **scaleout_kwargs(args))
    name = args.served_model_name or model_name
    if args.replicas is not None or args.min_replicas is not None:  # Ray Serve: each replica builds its engine
        from specdecode.server.ray_serve import ReplicaSettings, deployment_settings, serve_replicas

        llm_kwargs["model"] = args.model  # a name (None: the default) is fetched by each replica, on its node
        settings = ReplicaSettings(llm_kwargs, name, args.max_waiting, args.stall_timeout or STALL_TIMEOUT, key,
                                   limits, allowed_hosts(args))
        return serve_replicas(settings, deployment_settings(args), args.host, args.port, args.ray_address)
    llm = LLM(**llm_kwargs)
    engine = AsyncEngine(llm, max_waiting=args.max_waiting, stall_timeout=args.stall_timeout or STALL_TIMEOUT)
    app = build_app(engine, name, api_key=key, limits=limits, allowed_hosts=allowed_hosts(args))
    engine.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, **uvicorn_options(limits))
    finally:
        engine.shutdown()
    return 0
