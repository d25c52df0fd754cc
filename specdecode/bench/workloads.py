"""Benchmark workloads for models without a chat template, built from a fixed list of standard-library files
(workloads/heldout.json: the files a hash of their path holds out, the split `specdecode train lm` makes).

- completion: the code before a function and its first lines; the model continues the function.
- grounded_edit: a function, then an instruction to rewrite it and the start of the rewrite; the answer copies
  much of the prompt (the case prompt lookup is made for).
- docstring: a function signature and an opened docstring; free-form prose.

`python -m specdecode.bench.workloads` regenerates the shipped workloads/*.json from that list.
"""
from __future__ import annotations

import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

WORKLOAD_DIR = Path(__file__).resolve().parent / "workloads"
WORKLOADS = ("completion", "grounded_edit", "docstring")
PROMPTS_PER_WORKLOAD = 16
MAX_PROMPT_CHARS = 900
"""Keeps prompt + 128 generated tokens inside a 512-token context."""


def load_workload(name: str, limit: int | None = None) -> list[str]:
    path = WORKLOAD_DIR / f"{name}.json"
    if name not in WORKLOADS or not path.is_file():
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    prompts = json.loads(path.read_text())["prompts"]
    return prompts[:limit] if limit else prompts


def heldout_files() -> list[str]:
    """The standard-library files the workloads are built from, relative to the stdlib folder."""
    return json.loads((WORKLOAD_DIR / "heldout.json").read_text())["files"]


def _functions(source: str) -> list[tuple[int, int, ast.FunctionDef]]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.end_lineno and 6 <= node.end_lineno - node.lineno <= 30:
            out.append((node.lineno - 1, node.end_lineno, node))
    return sorted(out, key=lambda t: t[0])


def heldout_sources(heldout_files: list[str], corpus: Path) -> Iterator[tuple[str, str, list[str]]]:
    """(relative path, source, its lines with their ends) of each readable held-out file, in sorted order."""
    for rel in sorted(heldout_files):
        try:
            source = (corpus / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield rel, source, source.splitlines(keepends=True)


def build_prompts(heldout_files: list[str], corpus: Path) -> dict[str, list[str]]:
    prompts: dict[str, list[str]] = {name: [] for name in WORKLOADS}
    for rel, source, lines in heldout_sources(heldout_files, corpus):
        for start, end, node in _functions(source)[:2]:  # at most two functions per file, for variety
            body = "".join(lines[start:end])
            head = lines[start]
            indent = head[:len(head) - len(head.lstrip())] + "    "
            candidates = {
                "completion": "".join(lines[max(0, start - 15):start + 4]),
                "grounded_edit": f"{body}\n\n# The same function, with type hints added and the logic unchanged:\n{head}",
                "docstring": f'{head}{indent}"""' if ast.get_docstring(node) is None else "",
            }
            for name, prompt in candidates.items():
                if prompt and len(prompt) <= MAX_PROMPT_CHARS and len(prompts[name]) < PROMPTS_PER_WORKLOAD:
                    prompts[name].append(prompt)
        if all(len(p) >= PROMPTS_PER_WORKLOAD for p in prompts.values()):
            break
    return prompts


def main() -> None:
    corpus = Path(sysconfig.get_paths()["stdlib"])
    for name, prompts in build_prompts(heldout_files(), corpus).items():
        (WORKLOAD_DIR / f"{name}.json").write_text(json.dumps({"workload": name, "prompts": prompts}, indent=1))
        print(f"{name}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
