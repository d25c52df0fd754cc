"""Greedy pass rate on small coding problems (workloads/code_problems.json), through our engine and through
llama.cpp on the same GGUF: each problem's chat prompt is answered greedily, the definitions in the answer's code
are run with the problem's asserts in a sandboxed subprocess, and the two engines' verdicts are set side by side.
`specdecode bench code` runs it; the goal is that the two pass rates agree within one problem.

Same prompt for both: our chat template renders the text and our tokenizer its ids; llama-completion gets that text
byte for byte (bench/llama_cpp.py). Unlike the speed comparison, both stop at an end-of-sequence token: an answer is
what the model writes before it.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import gc
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specdecode.bench.workloads import WORKLOAD_DIR
from specdecode.errors import ConfigError

PROBLEMS_FILE = WORKLOAD_DIR / "code_problems.json"
MAX_TOKENS = 512
"""Most new tokens per answer."""
TIMEOUT_S = 5.0
"""Wall-clock limit of one solution's run with its tests."""
MEMORY_LIMIT = 4 << 30
"""Address-space limit of that run, bytes."""
ENGINES = ("specdecode", "llama.cpp")


@dataclasses.dataclass
class Problem:
    """One coding problem of the workload."""

    id: str
    prompt: str
    """The user's chat message: one function's signature and what it must do."""
    entry_point: str
    """Name of the function the tests call."""
    tests: str
    """Python assert lines calling the function, one statement a line."""


@dataclasses.dataclass
class Verdict:
    """How a piece of code fared against a problem's tests."""

    passed: bool
    reason: str
    """One line: "passed", the first failing assert and what the call returned, an exception, or a timeout."""


@dataclasses.dataclass
class Attempt:
    """One engine's greedy answer to one problem, and its verdict."""

    problem: str
    engine: str
    """"specdecode" or "llama.cpp"."""
    answer: str
    """The generated text."""
    tokens: int
    """Tokens generated."""
    finish_reason: str
    """"stop" (an end-of-sequence token) or "length" (the token limit)."""
    passed: bool = False
    reason: str = ""


def load_problems(limit: int | None = None, path: Path = PROBLEMS_FILE) -> list[Problem]:
    """The workload's problems, the first `limit` of them if given."""
    problems = [Problem(**p) for p in json.loads(Path(path).read_text())["problems"]]
    return problems[:limit] if limit else problems


# -- grading ------------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S | re.M)
_PYTHON_TAGS = {"python", "python3", "py"}


def extract_code(answer: str) -> str:
    """The code of a model's answer: its first ```python block, else its first fenced block without a language,
    else the whole text. A block the token limit cut off runs to the end of the text."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(answer)]
    for wanted in (lambda tag: tag in _PYTHON_TAGS, lambda tag: tag == ""):
        body = next((body for tag, body in blocks if wanted(tag)), None)
        if body is not None:
            return body
    return answer


_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
                ast.AnnAssign)


def keep_definitions(code: str) -> str:
    """The code's top-level imports, definitions and assignments, without the rest: small models append their own
    checks (asserts, calls, `if __name__ == "__main__":` demos), often with wrong expected values, and the verdict
    is about the function. Code that does not parse is returned as is (its run reports the SyntaxError)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return code
    lines = code.split("\n")
    kept = []
    for node in tree.body:
        if isinstance(node, _DEFINITIONS):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            kept.append("\n".join(lines[first - 1:node.end_lineno]))
    return "\n".join(kept) + "\n" if kept else ""


# Runs in the sandbox: the solution, then each test statement until one fails; the verdict goes to the real
# stdout as the last line, whatever the solution prints (that goes nowhere).
_DRIVER = r'''
import ast, io, resource, socket, sys

def _no_network(*args, **kwargs):
    raise OSError("network access is disabled here")

socket.socket = socket.create_connection = socket.getaddrinfo = _no_network
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
verdict, sys.stdout = sys.stdout, io.StringIO()

def say(text):
    print(" ".join(str(text).split())[:300], file=verdict, flush=True)
    sys.exit(0 if text == "passed" else 1)

def call(tree, namespace):
    return eval(compile(ast.Expression(tree), "tests.py", "eval"), namespace)

namespace = {"__name__": "solution"}
try:
    exec(compile(open("solution.py", encoding="utf-8").read(), "solution.py", "exec"), namespace)
except BaseException as exc:
    say(f"the code raised {type(exc).__name__}: {exc}")
if not callable(namespace.get(sys.argv[1])):
    say(f"the code defines no function {sys.argv[1]}")
tests = open("tests.py", encoding="utf-8").read()
for statement in ast.parse(tests).body:
    line = ast.get_source_segment(tests, statement)
    try:
        exec(compile(ast.Module([statement], []), "tests.py", "exec"), namespace)
    except AssertionError:
        got = ""
        if isinstance(statement, ast.Assert) and isinstance(statement.test, ast.Compare):
            try:
                got = f" (got {call(statement.test.left, namespace)!r:.80})"
            except BaseException:
                pass
        say(f"failed: {line}{got}")
    except BaseException as exc:
        say(f"{line} raised {type(exc).__name__}: {exc}")
say("passed")
'''


@functools.cache
def _no_network_prefix() -> tuple[str, ...]:
    """`unshare -rn` (a user and network namespace: no interface but loopback) where this machine allows it; else
    nothing, and the driver's socket stubs are the only guard."""
    try:
        ok = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return ("unshare", "-rn") if ok else ()


def run_tests(code: str, tests: str, entry_point: str, timeout: float = TIMEOUT_S) -> Verdict:
    """Run the code, then the tests, in a fresh interpreter in a temporary directory: no network, no stdin,
    bounded memory, killed (with anything it started) after `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="specdecode-code-") as folder:
        Path(folder, "solution.py").write_text(code, encoding="utf-8")
        Path(folder, "tests.py").write_text(tests, encoding="utf-8")
        command = [*_no_network_prefix(), sys.executable, "-I", "-c", _DRIVER, entry_point, str(MEMORY_LIMIT)]
        proc = subprocess.Popen(command, cwd=folder, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
                                env={"PATH": os.environ.get("PATH", ""), "HOME": folder, "LC_ALL": "C.UTF-8"})
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Verdict(False, f"timed out after {timeout:g} s")
    said = out.strip().splitlines()
    if said:
        return Verdict(proc.returncode == 0 and said[-1] == "passed", said[-1])
    last = (err.strip().splitlines() or ["no output"])[-1]
    return Verdict(False, f"the run ended with status {proc.returncode}: {last}"[:300])


def grade(attempt: Attempt, problem: Problem, timeout: float = TIMEOUT_S) -> Attempt:
    """The attempt with its verdict on the problem's tests: its code's definitions (extract_code, then
    keep_definitions) run with them."""
    code = keep_definitions(extract_code(attempt.answer))
    verdict = run_tests(code, problem.tests, problem.entry_point, timeout)
    return dataclasses.replace(attempt, passed=verdict.passed, reason=verdict.reason)


# -- answering ----------------------------------------------------------------------------------------------

def chat_prompt(tokenizer, problem: Problem) -> tuple[str, list[int]]:
    """The problem as one user message in the model's chat template: (text, ids); the ids are encode_chat's."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": problem.prompt}])
    return text, tokenizer.encode(text, add_special_tokens=False)


def answer_ours(llm, prompts: dict[str, list[int]], max_tokens: int = MAX_TOKENS) -> list[Attempt]:
    """Our engine's greedy answers to every prompt (problem id -> ids), in one batch (greedy outputs do not depend
    on the batch)."""
    from specdecode.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.generate(list(prompts.values()), params, use_tqdm=True)
    return [Attempt(problem, "specdecode", out.outputs[0].text, len(out.outputs[0].token_ids),
                    out.outputs[0].finish_reason) for problem, out in zip(prompts, outputs)]


def answer_llama(peer, model: Path, problem: str, text: str, prompt_tokens: int,
                 max_tokens: int = MAX_TOKENS) -> Attempt:
    """llama.cpp's greedy answer to the prompt text: llama-completion with LlamaCpp.complete's flags, stopping at
    an end-of-generation token (as complete(ignore_eos=False), but saying whether it stopped there)."""
    from specdecode.bench.llama_cpp import END_OF_TEXT, _prompt_file, parse_completion_log

    with _prompt_file(text) as path:
        flags = peer._common(model, path, max_tokens, prompt_tokens + max_tokens + 16, ignore_eos=False)
        out, log = peer._run("llama-completion", flags + ["-no-cnv", "--no-display-prompt"])
    out = out.removesuffix("\n\n")  # printed at exit
    stopped = out.endswith(END_OF_TEXT)
    return Attempt(problem, "llama.cpp", out.removesuffix(END_OF_TEXT), parse_completion_log(log)["tokens"],
                   "stop" if stopped else "length")


def gguf_file(model: str | Path) -> Path:
    """The GGUF file a --model names, for llama.cpp (which runs nothing else)."""
    from specdecode.catalog.registry import resolve_model
    from specdecode.model.gguf import find_gguf

    found = find_gguf(resolve_model(model))
    if found is None:
        raise ConfigError(f"--llama-cpp runs the same GGUF file as ours; {model} is not one (pass a .gguf)")
    return found


def run_eval(model: str | Path, problems: list[Problem], llama_cpp: Path | None = None, threads: int = 1,
             max_tokens: int = MAX_TOKENS, log=print) -> dict:
    """Answer every problem greedily with our engine (plain decoding) and, given a llama.cpp bin directory, with
    llama.cpp on the same GGUF; grade every answer. Returns what results.json holds."""
    from specdecode.engine.llm import LLM
    from specdecode.hardware import cpu_name

    peer = gguf = None
    if llama_cpp is not None:
        from specdecode.bench.llama_cpp import LlamaCpp

        peer, gguf = LlamaCpp(llama_cpp, threads), gguf_file(model)  # both fail here, before any loading
    start = time.perf_counter()
    log(f"code eval: loading {model} (plain decoding, {threads} thread{'s' * (threads > 1)})")
    llm = LLM(model, speculative_config=None, threads=threads)
    tokenizer = llm.tokenizer
    rendered = {p.id: chat_prompt(tokenizer, p) for p in problems}
    log(f"code eval: specdecode answers {len(problems)} problems (greedy, at most {max_tokens} tokens)")
    attempts = answer_ours(llm, {pid: ids for pid, (_, ids) in rendered.items()}, max_tokens)
    kernels, dtype = llm.quantization, str(llm.target.dtype).removeprefix("torch.")
    formats = {"specdecode": f"{kernels} kernels, {dtype}" if kernels else f"float weights, {dtype}"}
    del llm
    gc.collect()  # llama.cpp loads its own copy of the weights next
    same_ids = {}
    if peer is not None:
        formats["llama.cpp"] = peer.weights_format(gguf)
        if kernels == "gguf":  # the GGUF's own blocks, as llama.cpp names them
            formats["specdecode"] = f"{formats['llama.cpp']} kernels, {dtype}"
        for n, (pid, (text, ids)) in enumerate(rendered.items()):
            same_ids[pid] = peer.tokenize(gguf, text) == ids
            log(f"code eval: llama.cpp {n + 1}/{len(problems)} {pid} ({len(ids)} prompt tokens, "
                f"{'same' if same_ids[pid] else 'DIFFERENT'} ids in llama.cpp)")
            attempts.append(answer_llama(peer, gguf, pid, text, len(ids), max_tokens))
    by_id = {p.id: p for p in problems}
    attempts = [grade(a, by_id[a.problem]) for a in attempts]
    return {"model": str(model), "cpu": cpu_name(), "threads": threads, "max_tokens": max_tokens,
            "llama_cpp": llama_cpp and str(llama_cpp), "formats": formats, "seconds": time.perf_counter() - start,
            "same_prompt_ids": same_ids, "summary": summarize(problems, attempts),
            "attempts": [dataclasses.asdict(a) for a in attempts]}


# -- report -------------------------------------------------------------------------------------------------

def summarize(problems: list[Problem], attempts: list[Attempt]) -> dict:
    """Per problem each engine's verdict; per engine its passes; how many problems the engines disagree on, and
    whether their pass counts are within one problem of each other (the goal)."""
    verdicts = {(a.problem, a.engine): a for a in attempts}
    engines = [e for e in ENGINES if any(a.engine == e for a in attempts)]
    passes = {e: sum(verdicts[(p.id, e)].passed for p in problems) for e in engines}
    rows = []
    for p in problems:
        row = {"problem": p.id, **{e: verdicts[(p.id, e)].passed for e in engines}}
        if len(engines) == 2:
            ours, theirs = (verdicts[(p.id, e)] for e in engines)
            row["same_answer"] = ours.answer == theirs.answer
        rows.append(row)
    out = {"problems": len(problems), "passed": passes,
           "pass_rate": {e: n / len(problems) for e, n in passes.items()}, "rows": rows}
    if len(engines) == 2:
        out["verdicts_differ"] = sum(row[engines[0]] != row[engines[1]] for row in rows)
        out["same_answers"] = sum(row["same_answer"] for row in rows)
        out["within_one"] = abs(passes[engines[0]] - passes[engines[1]]) <= 1
    return out


def _cell(attempt: dict) -> str:
    if attempt["passed"]:
        return "pass"
    reason = attempt["reason"] if len(attempt["reason"]) <= 60 else attempt["reason"][:57] + "..."
    return "fail: " + reason.replace("|", "\\|")


def render_markdown(result: dict) -> str:
    summary = result["summary"]
    engines = list(summary["passed"])
    attempts = {(a["problem"], a["engine"]): a for a in result["attempts"]}
    lines = [f"# Greedy pass rate on {summary['problems']} coding problems", "",
             f"Model `{result['model']}`, greedy, at most {result['max_tokens']} new tokens, {result['threads']} "
             f"thread(s), {result['cpu']}.", "", "| engine | weights | passed | pass rate |", "|---|---|---|---|"]
    lines += [f"| {e} | {result['formats'].get(e, '')} | {summary['passed'][e]}/{summary['problems']} | "
              f"{summary['pass_rate'][e]:.1%} |" for e in engines]
    if "verdicts_differ" in summary:
        lines += ["", f"Problems whose verdicts differ: {summary['verdicts_differ']}; identical answers: "
                  f"{summary['same_answers']}/{summary['problems']}; pass counts within one problem: "
                  f"{'yes' if summary['within_one'] else 'NO'}."]
    lines += ["", "| problem | " + " | ".join(engines) + (" | same answer |" if len(engines) == 2 else " |"),
              "|---" * (len(engines) + 1 + (len(engines) == 2)) + "|"]
    for row in summary["rows"]:
        cells = [_cell(attempts[(row["problem"], e)]) for e in engines]
        if len(engines) == 2:
            cells.append("yes" if row["same_answer"] else "no")
        lines.append(f"| {row['problem']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(result: dict, out: Path) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"results": out / "results.json", "report": out / "report.md"}
    paths["results"].write_text(json.dumps(result, indent=1) + "\n")
    paths["report"].write_text(render_markdown(result))
    return paths


def cmd_bench_code(args) -> int:
    """`specdecode bench code`."""
    problems = load_problems(args.limit)
    result = run_eval(args.model, problems, args.llama_cpp, args.threads, args.max_tokens)
    paths = write_report(result, args.out)
    print(paths["report"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
