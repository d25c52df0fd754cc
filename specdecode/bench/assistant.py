"""`specdecode bench assistant`: what a code assistant asks of a small coder pair, decoded by ours (plain, the draft
model, prompt lookup, auto with the draft) and by llama.cpp (plain, `llama-speculative` with the same draft GGUF,
`llama-lookup`) on the same files, at each thread count, greedy, each engine stopping at its end-of-turn token.

Three categories of requests, in the model's chat template (llama.cpp gets the very text we render, as in
llama_cpp.py):
- generate: small Python problems (workloads/code_problems.json); every engine's answer is run against the
  problem's asserts (code_eval.py's sandbox), so a speed row also says whether its code works;
- edit: a held-out standard-library function (workloads/grounded_edit.json) with an instruction to change it (type
  hints, a docstring, clearer names) and return it whole;
- multi_turn: a conversation that refactors one function over three turns; turns two and three are the requests,
  their history holds our plain decoding's own earlier answers.

Decode tokens/s counts the tokens after the first over the seconds after the first token, for every engine alike
(llama_cpp.py's module docstring); each row's figure on a request is a ratio to llama.cpp plain's on it. Ours are
checked token for token against our plain decoding (speculation must not change a greedy answer).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path

from specdecode.errors import ConfigError

CATEGORIES = ("generate", "edit", "multi_turn")

EDIT_ASKS = ("Add type hints to this function and return the whole function, otherwise unchanged.",
             "Add a docstring to this function and return the whole function, otherwise unchanged.",
             "Rename the local variables of this function to clearer names and return the whole function.")
"""Edit instructions, taken in turn."""

FOLLOW_UPS = ("Now also add a docstring, and return the whole function again.",
              "Now rename any short variable names to clearer ones, and return the whole function again.")
"""The second and third turns of a multi_turn conversation (its first is an EDIT_ASKS[0] edit)."""

LLAMA_SPECULATIVE_DRAFTS = 4
"""llama-speculative's --spec-draft-n-max: its better setting on this pair (4 drafts beat 8 there, NOTES.md)."""


@dataclasses.dataclass
class Request:
    category: str
    name: str
    messages: list[dict]
    problem: object = None
    """The code_eval Problem whose tests grade the answer (generate only)."""


@dataclasses.dataclass
class Row:
    """One engine's answer to one request at one thread count."""

    threads: int
    engine: str
    """e.g. "specdecode draft_model" or "llama.cpp speculative"."""
    category: str
    request: str
    tokens: int
    decode_tokens_per_s: float
    drafted: int = 0
    accepted: int = 0
    text: str = ""
    passed: bool | None = None
    """The answer's code passed the problem's tests (generate only)."""


def functions(count: int, skip: int = 0) -> list[str]:
    """Held-out standard-library functions (the source before grounded_edit.json's cue line)."""
    data = json.loads((Path(__file__).parent / "workloads" / "grounded_edit.json").read_text())
    bodies = [p.split("\n\n\n# ")[0].rstrip() + "\n" for p in data["prompts"]]
    if skip + count > len(bodies):
        raise ConfigError(f"--prompts {count} asks for more functions than the workload holds ({len(bodies) // 2})")
    return bodies[skip:skip + count]


def code_message(ask: str, code: str) -> dict:
    return {"role": "user", "content": f"{ask}\n\n```python\n{code}```"}


def build_requests(count: int, answer, fits=lambda messages: True) -> list[Request]:
    """`count` requests per category (fewer where a prompt would not fit: fits(messages) says); answer(messages) ->
    text is our plain decoding's reply (multi_turn histories)."""
    from specdecode.bench.code_eval import load_problems

    requests = [Request("generate", p.id, [{"role": "user", "content": p.prompt}], p) for p in load_problems(count)]
    for i, code in enumerate(functions(count)):
        requests.append(Request("edit", f"edit:{i}", [code_message(EDIT_ASKS[i % len(EDIT_ASKS)], code)]))
    for i, code in enumerate(functions((count + 1) // 2, skip=count)):
        messages = [code_message(EDIT_ASKS[0], code)]
        for turn, follow_up in enumerate(FOLLOW_UPS, start=2):
            if not fits(messages):
                break
            messages = [*messages, {"role": "assistant", "content": answer(messages)},
                        {"role": "user", "content": follow_up}]
            requests.append(Request("multi_turn", f"conversation:{i}:turn{turn}", messages))
    return [r for r in requests if fits(r.messages)]


@dataclasses.dataclass
class AssistantConfig:
    model: str
    draft: str
    llama_cpp: Path | None = None
    threads: tuple[int, ...] = (1,)
    prompts: int = 2
    max_tokens: int = 256
    num_speculative_tokens: int = 8
    dtype: str = "auto"


def our_configs(config: AssistantConfig) -> dict:
    k = config.num_speculative_tokens
    return {"plain": None,
            "draft_model": {"method": "draft_model", "model": config.draft, "num_speculative_tokens": k},
            "ngram": {"method": "ngram", "num_speculative_tokens": k},
            "auto": {"method": "auto", "model": config.draft, "num_speculative_tokens": k}}


def run_assistant(config: AssistantConfig, log=print) -> dict:
    import torch

    from specdecode.bench.code_eval import extract_code, gguf_file, keep_definitions, run_tests
    from specdecode.bench.llama_cpp import LlamaCpp
    from specdecode.bench.measure import trace_generate
    from specdecode.engine.llm import LLM
    from specdecode.hardware import cpu_name
    from specdecode.sampling import SamplingParams

    target_gguf = draft_gguf = None
    if config.llama_cpp is not None:
        LlamaCpp(config.llama_cpp)  # fails here, in one line, on a folder without its binaries
        target_gguf, draft_gguf = gguf_file(config.model), gguf_file(config.draft)
    torch.set_num_threads(config.threads[0])
    log(f"assistant: loading {config.model} four times (plain, draft_model, ngram, auto; draft {config.draft})")
    ours = {name: LLM(config.model, speculative_config=spec, max_num_seqs=1, dtype=config.dtype)
            for name, spec in our_configs(config).items()}
    tokenizer = ours["plain"].tokenizer
    params = SamplingParams(temperature=0, max_tokens=config.max_tokens)

    def answer(messages):
        return ours["plain"].chat(messages, params)[0].outputs[0].text

    room = ours["plain"].max_model_len - config.max_tokens
    requests = build_requests(config.prompts, answer, lambda messages: len(tokenizer.encode_chat(messages)) <= room)
    log(f"assistant: {len(requests)} requests ({', '.join(CATEGORIES)}), engines {len(ours)} ours"
        + (" + 3 llama.cpp" if target_gguf else ""))
    rows: list[Row] = []
    for threads in config.threads:
        torch.set_num_threads(threads)
        for llm in ours.values():  # suffix decoding must not remember the answers of another thread count
            if hasattr(llm.proposer, "forget_finished"):
                llm.proposer.forget_finished()
        peer = LlamaCpp(config.llama_cpp, threads=threads) if target_gguf else None
        for n, request in enumerate(requests):
            text = tokenizer.apply_chat_template(request.messages)
            ids = tokenizer.encode(text, add_special_tokens=False)
            log(f"assistant: {threads} thread{'s' * (threads > 1)}, request {n + 1}/{len(requests)} "
                f"({request.name}, {len(ids)} prompt tokens)")
            for name, llm in ours.items():
                trace = trace_generate(llm, ids, params)
                count = len(trace.token_ids)
                rate = (count - 1) / (trace.seconds - trace.ttft) if count > 1 else 0.0
                rows.append(Row(threads, f"specdecode {name}", request.category, request.name, count, rate,
                                trace.stats.draft_tokens, trace.stats.accepted_tokens,
                                tokenizer.decode(trace.token_ids)))
            if peer is not None:
                runs = {"plain": lambda: peer.complete(target_gguf, text, config.max_tokens, len(ids),
                                                       ignore_eos=False),
                        "speculative": lambda: peer.speculative(target_gguf, draft_gguf, text, config.max_tokens,
                                                                len(ids), LLAMA_SPECULATIVE_DRAFTS),
                        "lookup": lambda: peer.lookup(target_gguf, text, config.max_tokens, len(ids),
                                                      config.num_speculative_tokens, ignore_eos=False)}
                for mode, run in runs.items():
                    r = run()
                    rows.append(Row(threads, f"llama.cpp {mode}", request.category, request.name, r.tokens,
                                    r.decode_tokens_per_s, r.drafted, r.accepted, r.text))
        gc.collect()
    problems = {r.name: r.problem for r in requests if r.problem is not None}
    for row in rows:
        if row.request in problems:
            problem = problems[row.request]
            row.passed = run_tests(keep_definitions(extract_code(row.text)), problem.tests, problem.entry_point).passed
    return {"model": config.model, "draft": config.draft, "cpu": cpu_name(), "threads": list(config.threads),
            "max_tokens": config.max_tokens, "num_speculative_tokens": config.num_speculative_tokens,
            "llama_speculative_drafts": LLAMA_SPECULATIVE_DRAFTS, "llama_cpp": config.llama_cpp and str(config.llama_cpp),
            "requests": [dataclasses.asdict(r) | {"problem": None} for r in requests],
            "rows": [dataclasses.asdict(r) for r in rows], "summary": summarize(rows)}


def summarize(rows: list[Row]) -> list[dict]:
    """Per thread count and engine: per category the median decode tokens/s and the median ratio to the reference
    row on the same requests (llama.cpp plain if it ran, else our plain); acceptance; greedy answers identical to
    our plain's; tests passed."""
    out = []
    for threads in dict.fromkeys(r.threads for r in rows):
        at = [r for r in rows if r.threads == threads]
        engines = list(dict.fromkeys(r.engine for r in at))
        reference = "llama.cpp plain" if "llama.cpp plain" in engines else "specdecode plain"
        ref = {r.request: r for r in at if r.engine == reference}
        plain = {r.request: r.text for r in at if r.engine == "specdecode plain"}
        for engine in engines:
            mine = [r for r in at if r.engine == engine]
            entry = {"threads": threads, "engine": engine, "reference": reference}
            for category in CATEGORIES + ("all",):
                group = [r for r in mine if category in ("all", r.category)]
                ratios = [r.decode_tokens_per_s / ref[r.request].decode_tokens_per_s for r in group
                          if ref[r.request].decode_tokens_per_s > 0]
                entry[category] = {"tokens_per_s": statistics.median(r.decode_tokens_per_s for r in group),
                                   "ratio": statistics.median(ratios) if ratios else None}
            drafted = sum(r.drafted for r in mine)
            entry["acceptance"] = sum(r.accepted for r in mine) / drafted if drafted else None
            if engine.startswith("specdecode"):
                entry["same_as_plain"] = sum(r.text == plain[r.request] for r in mine)
            graded = [r.passed for r in mine if r.passed is not None]
            entry["tests_passed"] = f"{sum(graded)}/{len(graded)}" if graded else None
            entry["requests"] = len(mine)
            out.append(entry)
    return out


def render_markdown(result: dict) -> str:
    lines = [f"# Code-assistant workload: {result['model']} with {result['draft']} drafting", "",
             f"CPU: {result['cpu']}; greedy, at most {result['max_tokens']} tokens, each engine stopping at its "
             f"end-of-turn token; ours draft up to {result['num_speculative_tokens']} (adaptive), llama-lookup "
             f"{result['num_speculative_tokens']}, llama-speculative {result['llama_speculative_drafts']}. Decode "
             "tokens/s (median over a category's requests) and the median ratio to the reference row on the same "
             "requests.", ""]
    for threads in result["threads"]:
        rows = [r for r in result["summary"] if r["threads"] == threads]
        lines += [f"## {threads} thread{'s' * (threads > 1)} (ratios to {rows[0]['reference']})", "",
                  "| engine | " + " | ".join(CATEGORIES) + " | all | acceptance | same as our plain | tests passed |",
                  "|---|" + "---:|" * (len(CATEGORIES) + 1) + "---:|---:|---:|"]
        for r in rows:
            cells = [f"{r[c]['tokens_per_s']:.1f} ({r[c]['ratio']:.2f}x)" if r[c]["ratio"] is not None
                     else f"{r[c]['tokens_per_s']:.1f}" for c in CATEGORIES + ("all",)]
            lines.append(f"| {r['engine']} | " + " | ".join(cells)
                         + f" | {'' if r['acceptance'] is None else format(r['acceptance'], '.0%')}"
                         + f" | {r.get('same_as_plain', '') if 'same_as_plain' in r else ''}"
                         + (f"/{r['requests']}" if "same_as_plain" in r else "")
                         + f" | {r['tests_passed'] or ''} |")
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Bars: each engine's ratio to the reference row, per category, one panel per thread count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = result["threads"]
    fig, axes = plt.subplots(1, len(threads), figsize=(6 * len(threads), 4), squeeze=False)
    for ax, t in zip(axes[0], threads):
        rows = [r for r in result["summary"] if r["threads"] == t]
        width = 0.8 / len(rows)
        for i, r in enumerate(rows):
            ax.bar([c + i * width for c in range(len(CATEGORIES) + 1)],
                   [r[c]["ratio"] or 0 for c in CATEGORIES + ("all",)], width, label=r["engine"])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(CATEGORIES) + 1)], [*CATEGORIES, "all"])
        ax.set_title(f"{t} thread{'s' * (t > 1)}: decode speed / {rows[0]['reference']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draft_for(model: str, draft: str | None) -> str:
    """The draft a pair benchmark runs: the one given, else the target's catalog draft, else a one-line error."""
    from specdecode.catalog.registry import default_speculative_config

    draft = draft or (default_speculative_config(model) or {}).get("model")
    if not draft:
        raise ConfigError(f"{model} has no default draft model; pass --draft (a model name, .gguf or checkpoint "
                          "with its tokenizer)")
    return draft


def cmd_bench_assistant(args) -> int:
    """`specdecode bench assistant`."""
    config = AssistantConfig(args.model, draft_for(args.model, args.draft), args.llama_cpp, tuple(args.threads),
                             args.prompts, args.max_tokens, args.num_speculative_tokens, args.dtype)

    def plotted(result: dict) -> list[Path]:
        plot(result, args.out / "assistant.png")
        return [args.out / "assistant.png"]

    return write_run(args.out, lambda: run_assistant(config), render_markdown, plotted)


def write_run(out: Path, run, render, extra=None) -> int:
    """Time `run()`, write its result to out (results.json, report.md from `render`, and whatever `extra(result)`
    writes, returning the paths), print the report and what was written; the exit code 0."""
    start = time.perf_counter()
    result = run()
    result["seconds"] = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "report.md"]
    written[0].write_text(json.dumps(result, indent=1) + "\n")
    written[1].write_text(render(result))
    written += extra(result) if extra is not None else []
    print(render(result))
    print("wrote " + ", ".join(map(str, written)))
    return 0
