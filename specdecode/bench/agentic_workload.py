"""The agentic edit-loop workload (`workloads/agentic_edit.json`): where answers repeat earlier answers.

A coding agent works on one function at a time, in sessions of TURNS requests. Every request of a session holds
the same system prompt, the function (a held-out standard-library function, as in workloads.py) and the agent's
log of the turns before it: the edit it asked for and the test run's result, never the answer it got (agents that
keep only tool results in their context do this). Each request asks for the complete function again, with the next
edit. So each answer re-emits, mostly, what the model answered to the previous requests of its session, which are
in no prompt: only a drafter that remembers earlier requests (suffix decoding) can draft it; prompt lookup sees the
function in the prompt only. Requests are meant to run in order, through one engine.

Deterministic: the first SESSIONS held-out files (sorted) that have a function of 6 to 30 lines of at most
MAX_FUNCTION_CHARS, their first such function, fixed edits and test messages.
`python -m specdecode.bench.agentic_workload` regenerates the file.
"""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from specdecode.bench.workloads import WORKLOAD_DIR, _functions, heldout_files, heldout_sources

NAME = "agentic_edit"
PATH = WORKLOAD_DIR / f"{NAME}.json"
SESSIONS = 8
TURNS = 4
MAX_FUNCTION_CHARS = 700
"""Keeps a request (system prompt, function, log) plus a 256-token answer well inside SmolLM2's context."""
SYSTEM = ("You are a coding agent. Each reply is the complete updated function in one ```python code block, "
          "with no explanation.")
EDITS = ("add type hints to every argument and the return value",
         "add a one-line docstring",
         "rename the local variables to clearer names",
         "add a comment above each branch")
TEST_RESULTS = ("tests failed: AssertionError in test_{name}_basic",
                "tests failed: TypeError in test_{name}_edge_cases",
                "tests failed: 1 of 12 tests in test_{name}")


def session(path: str, function: str, name: str) -> list[dict]:
    """The TURNS requests of one session, as {"messages": [...], "source": ...}."""
    requests = []
    for turn in range(TURNS):
        log = "".join(f"- turn {i + 1}: asked to {EDITS[i]}; {TEST_RESULTS[i % len(TEST_RESULTS)].format(name=name)}\n"
                      for i in range(turn))
        user = (f"File {path}:\n```python\n{function}```\n"
                + (f"Log of earlier turns:\n{log}" if log else "")
                + f"Task: {EDITS[turn]}. Reply with the complete function.")
        requests.append({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                         "source": f"stdlib:{path}:{name}:turn{turn + 1}"})
    return requests


def build(heldout_files: list[str], corpus: Path) -> list[dict]:
    requests: list[dict] = []
    for rel, source, lines in heldout_sources(heldout_files, corpus):
        for start, end, node in _functions(source):
            function = "".join(lines[start:end])
            if len(function) <= MAX_FUNCTION_CHARS:
                requests += session(rel, function, node.name)
                break
        if len(requests) >= SESSIONS * TURNS:
            break
    return requests


def load(limit: int | None = None) -> list[dict]:
    """The workload's requests in order (the first `limit` sessions)."""
    requests = json.loads(PATH.read_text())["categories"][NAME]
    return requests[:limit * TURNS] if limit else requests


def main() -> None:
    requests = build(heldout_files(), Path(sysconfig.get_paths()["stdlib"]))
    PATH.write_text(json.dumps({"workload": NAME, "turns_per_session": TURNS, "categories": {NAME: requests}},
                               indent=1))
    print(f"{NAME}: {len(requests)} requests ({len(requests) // TURNS} sessions of {TURNS})")


if __name__ == "__main__":
    main()
