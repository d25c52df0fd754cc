"""`specdecode bench fim`: edits in the middle of real files, as a code editor asks for them (fill in the middle),
decoded by ours (plain, prompt lookup, auto with the draft) and by llama.cpp (plain `llama-completion`,
`llama-lookup`) on the same prompt tokens, greedy, each engine stopping at its end-of-generation tokens.

The edits: a fixed list of standard-library modules of the Python that runs the benchmark (their sha256 go into the
results), one edit each, the kind taken in turn, the span picked by a seeded rule over the module's functions:
- body: a function's body (after its docstring) removed;
- lines: two to four consecutive statements (3-8 lines) of a function removed;
- rename: a parameter renamed in the signature, the body to be rewritten with the new name; the function as it was
  before the rename rides along as another file (as the recent chunks llama.vscode sends in input_extra).
The prompt is the model card's format of the file around the span, a window of lines as llama.vscode sends:
<|fim_prefix|>{the PREFIX_LINES lines before}<|fim_suffix|>{the SUFFIX_LINES lines after}<|fim_middle|>; with another
file, the repo-level format that llama.cpp's /infill writes (model/fim.py infill_ids), the module's own name as the
current file's. (With the repo header and no other file, Qwen2.5-Coder-1.5B-Instruct does not end the middle: on
`def fibonacci(n):` it writes the body, then the suffix again and prose, in llama.cpp as here; the one-file format
ends it.) llama.cpp gets the prompt as text with its special tokens, and `llama-tokenize` checks its ids are ours.

Exact match: the middle written equals the span removed (both stripped of surrounding whitespace). "Then more": the
middle written starts with the span and goes on (what an editor that trims the answer, at the suffix or by
llama.cpp's n_indent, would show right). Decode tokens/s
counts the tokens after the first over the seconds after the first token (llama_cpp.py's docstring).
"""
from __future__ import annotations

import ast
import dataclasses
import gc
import hashlib
import random
import re
import statistics
import sysconfig
from pathlib import Path

from specdecode.errors import ConfigError

STDLIB_FILES = ("textwrap.py", "fnmatch.py", "shlex.py", "heapq.py", "glob.py", "calendar.py", "statistics.py",
                "netrc.py", "sched.py", "bisect.py", "colorsys.py", "queue.py")
"""Held out: none of them feeds the other code workloads (grounded_edit.json's functions come from elsewhere)."""

KINDS = ("body", "lines", "rename")
PREFIX_LINES, SUFFIX_LINES = 40, 20
"""Lines of the file before and after the span that the prompt holds."""


@dataclasses.dataclass
class Edit:
    name: str
    kind: str
    file: str
    prefix: str
    middle: str
    """What the model should write (the span removed, or rewritten with the new name)."""
    suffix: str
    files: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """Other files given as context (filename, text)."""


@dataclasses.dataclass
class Row:
    engine: str
    edit: str
    kind: str
    tokens: int
    decode_tokens_per_s: float
    exact: bool
    starts: bool = False
    """The output starts with the middle (exact, or the middle and then more)."""
    drafted: int = 0
    accepted: int = 0
    token_ids: list[int] | None = None
    text: str = ""


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _functions(tree: ast.AST) -> list[ast.FunctionDef]:
    return sorted((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                  key=lambda n: n.lineno)


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    """The statements after the docstring."""
    first = fn.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) and \
        isinstance(first.value.value, str)
    return fn.body[1:] if docstring else fn.body


def _split(lines: list[str], start: int, end: int, middle: str | None = None, prefix_lines: list[str] | None = None
           ) -> tuple[str, str, str]:
    """(prefix, middle, suffix) of the file's lines with lines[start:end] as the middle (the prefix ends with its
    newline, the suffix starts with the middle's), each side cut to its window."""
    before = (prefix_lines if prefix_lines is not None else lines[:start])[-PREFIX_LINES:]
    after = lines[end:end + SUFFIX_LINES]
    text = "\n".join(lines[start:end]) if middle is None else middle
    return "".join(line + "\n" for line in before), text, "".join("\n" + line for line in after)


def make_edit(path: Path, kind: str, tokenizer, max_middle_tokens: int, seed: int = 0) -> Edit | None:
    """One edit of the module at path (None when it has no function that fits)."""
    source = path.read_text()
    lines = source.split("\n")
    tree = ast.parse(source)
    rng = random.Random(f"{seed}:{path.name}:{kind}")

    def fits(text: str) -> bool:
        return 8 <= len(tokenizer.encode(text, add_special_tokens=False)) <= max_middle_tokens

    candidates = []
    for fn in _functions(tree):
        body = _body(fn)
        if not body:
            continue
        if kind == "body":
            start, end = body[0].lineno - 1, fn.end_lineno
            if end - start >= 2 and fits("\n".join(lines[start:end])):
                candidates.append((start, end, None, None, None))
        elif kind == "lines":
            for i in range(len(body)):
                for j in range(i + 1, min(i + 4, len(body))):
                    start, end = body[i].lineno - 1, body[j].end_lineno
                    if 3 <= end - start <= 8 and fits("\n".join(lines[start:end])):
                        candidates.append((start, end, None, None, None))
        else:
            start, end = body[0].lineno - 1, fn.end_lineno
            old_body = "\n".join(lines[start:end])
            for arg in fn.args.args + fn.args.kwonlyargs:
                name = arg.arg
                use = re.compile(rf"(?<![.\w]){name}\b")  # the name, not an attribute of the same name
                if name in ("self", "cls") or len(use.findall(old_body)) < 2:
                    continue
                new = f"{name}_value"
                head = lines[fn.lineno - 1:start]
                renamed_head = [use.sub(new, line) if k < fn.body[0].lineno - fn.lineno else line
                                for k, line in enumerate(head)]
                middle = use.sub(new, old_body)
                if end - start >= 2 and fits(middle):
                    original = "\n".join(lines[fn.lineno - 1:end]) + "\n"
                    candidates.append((start, end, middle, lines[:fn.lineno - 1] + renamed_head, original))
                break
    if not candidates:
        return None
    start, end, middle, prefix_lines, original = rng.choice(candidates)
    prefix, middle, suffix = _split(lines, start, end, middle, prefix_lines)
    files = [(f"{path.stem}_before_rename.py", original)] if original else []
    return Edit(f"{path.stem}:{kind}:{start + 1}-{end}", kind, path.name, prefix, middle, suffix, files)


def make_edits(count: int, tokenizer, max_middle_tokens: int, root: Path | None = None) -> list[Edit]:
    """`count` edits over STDLIB_FILES in order, the kinds in turn (a module without a fitting span is skipped)."""
    root = root or stdlib_dir()
    edits = []
    for i, name in enumerate(STDLIB_FILES):
        if len(edits) == count:
            break
        path = root / name
        if not path.is_file():
            continue
        edit = make_edit(path, KINDS[len(edits) % len(KINDS)], tokenizer, max_middle_tokens)
        if edit is not None:
            edits.append(edit)
    if len(edits) < count:
        raise ConfigError(f"only {len(edits)} edits could be made from {root}; ask for fewer (--edits)")
    return edits


def fim_prompt(tokenizer, fim, edit: Edit) -> list[int]:
    """The edit's prompt ids (module docstring)."""
    from specdecode.model.fim import fim_ids, infill_ids

    if edit.files:
        return infill_ids(tokenizer, fim, edit.prefix, edit.suffix, files=edit.files, current_file=edit.file)
    return fim_ids(tokenizer, fim, edit.prefix, edit.suffix)


END_PIECES = ("<|endoftext|>", "<|file_sep|>", "<|fim_pad|>", "<|repo_name|>", "<|im_end|>")


def llama_cpp_text(text: str) -> str:
    """llama.cpp's answer without the end token's piece that llama-lookup prints after it."""
    for piece in END_PIECES:
        text = text.removesuffix(piece)
    return text


def same_middle(text: str, middle: str) -> bool:
    return text.strip() == middle.strip()


def starts_with_middle(text: str, middle: str) -> bool:
    return text.strip().startswith(middle.strip())


@dataclasses.dataclass
class FimBenchConfig:
    model: str
    draft: str
    llama_cpp: Path | None = None
    edits: int = 9
    max_tokens: int = 128
    num_speculative_tokens: int = 8
    threads: int = 1


def our_configs(config: FimBenchConfig) -> dict:
    k = config.num_speculative_tokens
    return {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": k},
            "auto": {"method": "auto", "model": config.draft, "num_speculative_tokens": k}}


def run_fim(config: FimBenchConfig, log=print) -> dict:
    import torch

    from specdecode.bench.code_eval import gguf_file
    from specdecode.bench.llama_cpp import LlamaCpp
    from specdecode.bench.measure import trace_generate
    from specdecode.engine.llm import LLM, fim_params
    from specdecode.hardware import cpu_name
    from specdecode.model.fim import require_fim
    from specdecode.sampling import SamplingParams

    peer = target_gguf = None
    if config.llama_cpp is not None:
        peer = LlamaCpp(config.llama_cpp, threads=config.threads)
        target_gguf = gguf_file(config.model)
    torch.set_num_threads(config.threads)
    log(f"fim: loading {config.model} three times (plain, ngram, auto with {config.draft})")
    ours = {name: LLM(config.model, speculative_config=spec, max_num_seqs=1, max_model_len=4096)
            for name, spec in our_configs(config).items()}
    tokenizer = ours["plain"].tokenizer
    fim = require_fim(tokenizer, "bench fim")
    params = fim_params(SamplingParams(temperature=0, max_tokens=config.max_tokens), fim)
    edits = make_edits(config.edits, tokenizer, config.max_tokens - 16)
    root = stdlib_dir()
    rows: list[Row] = []
    prompts = []
    for n, edit in enumerate(edits):
        ids = fim_prompt(tokenizer, fim, edit)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        same_tokens = peer.tokenize(target_gguf, text) == ids if peer is not None else None
        prompts.append({"edit": edit.name, "prompt_tokens": len(ids), "same_tokens_in_llama_cpp": same_tokens,
                        **dataclasses.asdict(edit)})
        log(f"fim: edit {n + 1}/{len(edits)} ({edit.name}, {len(ids)} prompt tokens"
            + ("" if same_tokens is None else f", llama.cpp's ids {'equal' if same_tokens else 'DIFFER'}") + ")")
        for name, llm in ours.items():
            trace = trace_generate(llm, ids, params)
            count = len(trace.token_ids)
            rate = (count - 1) / (trace.seconds - trace.ttft) if count > 1 else 0.0
            middle = tokenizer.decode(trace.token_ids)
            rows.append(Row(f"specdecode {name}", edit.name, edit.kind, count, rate, same_middle(middle, edit.middle),
                            starts_with_middle(middle, edit.middle), trace.stats.draft_tokens,
                            trace.stats.accepted_tokens, list(trace.token_ids), middle))
        if peer is not None:
            for mode, run in (("plain", lambda: peer.complete(target_gguf, text, config.max_tokens, len(ids),
                                                              ignore_eos=False)),
                              ("lookup", lambda: peer.lookup(target_gguf, text, config.max_tokens, len(ids),
                                                             config.num_speculative_tokens, ignore_eos=False))):
                r = run()
                text = llama_cpp_text(r.text)
                rows.append(Row(f"llama.cpp {mode}", edit.name, edit.kind, r.tokens, r.decode_tokens_per_s,
                                same_middle(text, edit.middle), starts_with_middle(text, edit.middle), r.drafted,
                                r.accepted, None, text))
        gc.collect()
    files = {name: hashlib.sha256((root / name).read_bytes()).hexdigest() for name in dict.fromkeys(
        e.file for e in edits)}
    return {"model": config.model, "draft": config.draft, "cpu": cpu_name(), "threads": config.threads,
            "max_tokens": config.max_tokens, "num_speculative_tokens": config.num_speculative_tokens,
            "stdlib": str(root), "files_sha256": files, "llama_cpp": config.llama_cpp and str(config.llama_cpp),
            "edits": prompts, "rows": [dataclasses.asdict(r) for r in rows], "summary": summarize(rows)}


def summarize(rows: list[Row]) -> list[dict]:
    """Per engine: exact matches, median decode tokens/s and its median ratio to the reference (llama.cpp plain if
    it ran, else our plain) on the same edits, acceptance, and greedy outputs identical to the plain decoding of the
    same engine: token ids for ours; for llama.cpp's, the text over the shorter of the two (llama-lookup may write up
    to a draft past the token limit)."""
    engines = list(dict.fromkeys(r.engine for r in rows))
    reference = "llama.cpp plain" if "llama.cpp plain" in engines else "specdecode plain"
    ref = {r.edit: r for r in rows if r.engine == reference}
    out = []
    for engine in engines:
        mine = [r for r in rows if r.engine == engine]
        plain_name = "specdecode plain" if engine.startswith("specdecode") else "llama.cpp plain"
        plain = {r.edit: r for r in rows if r.engine == plain_name}
        same = sum((r.token_ids == plain[r.edit].token_ids) if r.token_ids is not None else
                   _same_text(r.text, plain[r.edit].text) for r in mine)
        ratios = [r.decode_tokens_per_s / ref[r.edit].decode_tokens_per_s for r in mine
                  if ref[r.edit].decode_tokens_per_s > 0]
        drafted = sum(r.drafted for r in mine)
        out.append({"engine": engine, "reference": reference, "edits": len(mine),
                    "exact": sum(r.exact for r in mine), "starts": sum(r.starts for r in mine),
                    "tokens_per_s": statistics.median(r.decode_tokens_per_s for r in mine),
                    "ratio": statistics.median(ratios) if ratios else None,
                    "acceptance": sum(r.accepted for r in mine) / drafted if drafted else None,
                    "same_as_plain": same,
                    "by_kind": {kind: {"exact": sum(r.exact for r in mine if r.kind == kind),
                                       "edits": sum(r.kind == kind for r in mine),
                                       "tokens_per_s": statistics.median(
                                           [r.decode_tokens_per_s for r in mine if r.kind == kind] or [0.0])}
                                for kind in KINDS}})
    return out


def _same_text(a: str, b: str) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def rescore(result: dict) -> dict:
    """The result with its llama.cpp texts cleaned (llama_cpp_text), every row scored again against its edit's middle
    and the summary recomputed from those rows (the timings untouched)."""
    middles = {e["edit"]: e["middle"] for e in result["edits"]}
    rows = []
    for raw in result["rows"]:
        row = Row(**raw)
        if row.token_ids is None:
            row.text = llama_cpp_text(row.text)
        middle = middles[row.edit]
        row.exact, row.starts = same_middle(row.text, middle), starts_with_middle(row.text, middle)
        rows.append(row)
    return {**result, "rows": [dataclasses.asdict(r) for r in rows], "summary": summarize(rows)}


def render_markdown(result: dict) -> str:
    rows = result["summary"]
    lines = [f"# Fill in the middle of standard-library files: {result['model']} (draft {result['draft']})", "",
             f"CPU: {result['cpu']}; {result['threads']} thread; {len(result['edits'])} edits "
             f"({', '.join(KINDS)} in turn) of {len(result['files_sha256'])} modules of {result['stdlib']}; greedy, "
             f"at most {result['max_tokens']} tokens, each engine stopping at its end tokens; ours draft up to "
             f"{result['num_speculative_tokens']} (adaptive), llama-lookup {result['num_speculative_tokens']}. "
             f"Ratio: median over edits of decode tokens/s to {rows[0]['reference']}'s on the same edit.", "",
             "| engine | exact middle | middle, then more | decode tok/s (median) | ratio | acceptance | "
             "greedy = its plain | " + " | ".join(f"{k}: exact, tok/s" for k in KINDS) + " |",
             "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(KINDS)]
    for r in rows:
        kinds = " | ".join(f"{r['by_kind'][k]['exact']}/{r['by_kind'][k]['edits']}, "
                           f"{r['by_kind'][k]['tokens_per_s']:.1f}" for k in KINDS)
        lines.append(f"| {r['engine']} | {r['exact']}/{r['edits']} | {r['starts'] - r['exact']}/{r['edits']} | "
                     f"{r['tokens_per_s']:.1f} | "
                     f"{'' if r['ratio'] is None else format(r['ratio'], '.2f') + 'x'} | "
                     f"{'' if r['acceptance'] is None else format(r['acceptance'], '.0%')} | "
                     f"{r['same_as_plain']}/{r['edits']} | {kinds} |")
    same = [e["same_tokens_in_llama_cpp"] for e in result["edits"]]
    if any(s is not None for s in same):
        lines += ["", f"llama.cpp's token ids of the prompt text equal ours on {sum(bool(s) for s in same)}/"
                      f"{len(same)} edits (llama-tokenize)."]
    return "\n".join(lines) + "\n"


def cmd_bench_fim(args) -> int:
    """`specdecode bench fim`."""
    from specdecode.bench.assistant import draft_for, write_run

    config = FimBenchConfig(args.model, draft_for(args.model, args.draft), args.llama_cpp, args.edits, args.max_tokens,
                            args.num_speculative_tokens, args.threads)
    return write_run(args.out, lambda: run_fim(config), render_markdown)
