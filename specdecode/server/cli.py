"""`specdecode serve`: the OpenAI-compatible server, speculating adaptively by default."""
from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.spec.config import METHODS


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
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded at once (default 32)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued beyond --max-num-seqs before new ones get 503 (default 256)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--dtype", default="auto", help="auto (default), float32, bfloat16 or float16")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", choices=METHODS, default=None,
                      help="draft_model (a small model drafts) or ngram (prompt lookup)")
    spec.add_argument("--speculative-model", type=Path, default=None,
                      help="draft checkpoint directory")
    spec.add_argument("--num-speculative-tokens", type=int, default=None,
                      help="most draft tokens per step K (default 5)")
    spec.add_argument("--num-drafts", type=int, default=None, help="draft_model: chains per step (default 1)")
    spec.add_argument("--no-speculation", action="store_true", help="plain decoding")
    spec.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                      help="choose K per step from measured costs (default); --no-adaptive always drafts K")
    spec.add_argument("--disable-by-batch-size", type=int, default=None,
                      help="never speculate while this many sequences run")
    p.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    p.set_defaults(func=cmd_serve, compare=False)


def cmd_serve(args) -> int:
    import uvicorn

    from specdecode.engine.async_engine import AsyncEngine
    from specdecode.engine.cli import resolve_models
    from specdecode.engine.llm import LLM
    from specdecode.errors import ConfigError
    from specdecode.server.app import build_app

    model_dir, config, model_name = resolve_models(args)
    if config is not None:
        config["adaptive"] = args.adaptive
        if args.disable_by_batch_size is not None:
            config["disable_by_batch_size"] = args.disable_by_batch_size
    if args.max_waiting < 0:
        raise ConfigError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    llm = LLM(model=model_dir, dtype=args.dtype, device=args.device, speculative_config=config,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    engine = AsyncEngine(llm, max_waiting=args.max_waiting)
    name = args.served_model_name or model_name
    app = build_app(engine, name, api_key=args.api_key)
    engine.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()
    return 0
