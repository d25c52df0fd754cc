"""The coding pass-rate benchmark (specdecode/bench/code_eval.py) without a model: code extraction from typical
answers, the sandboxed test run (pass, fail, exception, timeout, no network), llama.cpp's answer through a stand-in
binary, the report, the CLI's flags, and the workload itself: every problem passes with a reference solution and
fails with a wrong stub."""
import dataclasses
import json
import stat
import sys

import pytest

from specdecode.bench.code_eval import (Attempt, Problem, answer_llama, extract_code, grade, keep_definitions,
                                        load_problems, render_markdown, run_tests, summarize, write_report)
from specdecode.bench.llama_cpp import REQUIRED, LlamaCpp
from specdecode.cli import build_parser

REFERENCE = {
    "run_length": '''
def run_length(s):
    runs = []
    for ch in s:
        if runs and runs[-1][0] == ch:
            runs[-1] = (ch, runs[-1][1] + 1)
        else:
            runs.append((ch, 1))
    return runs
''',
    "is_palindrome_phrase": '''
def is_palindrome_phrase(text):
    kept = [c.lower() for c in text if c.isalnum()]
    return kept == kept[::-1]
''',
    "word_counts": '''
import re
from collections import Counter

def word_counts(text):
    return dict(Counter(w.lower() for w in re.findall(r"[A-Za-z]+", text)))
''',
    "caesar_shift": '''
def caesar_shift(text, k):
    out = []
    for c in text:
        if "a" <= c <= "z" or "A" <= c <= "Z":
            base = ord("a") if c.islower() else ord("A")
            out.append(chr(base + (ord(c) - base + k) % 26))
        else:
            out.append(c)
    return "".join(out)
''',
    "to_roman": '''
def to_roman(n):
    table = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
             (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]
    out = ""
    for value, symbol in table:
        count, n = divmod(n, value)
        out += symbol * count
    return out
''',
    "from_roman": '''
def from_roman(s):
    values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    total = 0
    for i, c in enumerate(s):
        v = values[c]
        total += -v if i + 1 < len(s) and values[s[i + 1]] > v else v
    return total
''',
    "binary_search": '''
def binary_search(items, target):
    lo, hi = 0, len(items)
    while lo < hi:
        mid = (lo + hi) // 2
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < len(items) and items[lo] == target else -1
''',
    "merge_intervals": '''
def merge_intervals(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
''',
    "transpose": '''
def transpose(matrix):
    return [list(column) for column in zip(*matrix)]
''',
    "flatten": '''
def flatten(nested):
    out = []
    for item in nested:
        if isinstance(item, list):
            out.extend(flatten(item))
        else:
            out.append(item)
    return out
''',
    "chunk": '''
def chunk(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]
''',
    "rotate_left": '''
def rotate_left(items, k):
    if not items:
        return []
    k %= len(items)
    return items[k:] + items[:k]
''',
    "group_by_value": '''
def group_by_value(d):
    out = {}
    for key in sorted(d):
        out.setdefault(d[key], []).append(key)
    return out
''',
    "add_counts": '''
def add_counts(a, b):
    total = {key: a.get(key, 0) + b.get(key, 0) for key in {**a, **b}}
    return {key: n for key, n in total.items() if n != 0}
''',
    "gcd_of": '''
from math import gcd

def gcd_of(numbers):
    g = 0
    for n in numbers:
        g = gcd(g, n)
    return g
''',
    "is_prime": '''
def is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True
''',
    "digital_root": '''
def digital_root(n):
    while n >= 10:
        n = sum(int(d) for d in str(n))
    return n
''',
    "fibonacci_upto": '''
def fibonacci_upto(limit):
    out, a, b = [], 0, 1
    while a <= limit:
        out.append(a)
        a, b = b, a + b
    return out
''',
    "parse_settings": '''
def parse_settings(text):
    out = {}
    for piece in text.split(";"):
        if piece.strip():
            key, _, value = piece.partition("=")
            out[key.strip()] = value.strip()
    return out
''',
    "parse_duration": '''
import re

def parse_duration(text):
    seconds = {"h": 3600, "m": 60, "s": 1}
    return sum(int(n) * seconds[unit] for n, unit in re.findall(r"(\\d+)([hms])", text))
''',
    "split_csv_line": '''
def split_csv_line(line):
    fields, field, quoted, i = [], "", False, 0
    while i < len(line):
        c = line[i]
        if quoted:
            if c == '"' and line[i + 1:i + 2] == '"':
                field += '"'
                i += 1
            elif c == '"':
                quoted = False
            else:
                field += c
        elif c == '"':
            quoted = True
        elif c == ",":
            fields.append(field)
            field = ""
        else:
            field += c
        i += 1
    return fields + [field]
''',
    "compare_versions": '''
from itertools import zip_longest

def compare_versions(a, b):
    for x, y in zip_longest(a.split("."), b.split("."), fillvalue="0"):
        if int(x) != int(y):
            return 1 if int(x) > int(y) else -1
    return 0
''',
    "brackets_balanced": '''
def brackets_balanced(s):
    pairs = {")": "(", "]": "[", "}": "{"}
    stack = []
    for c in s:
        if c in "([{":
            stack.append(c)
        elif c in pairs:
            if not stack or stack.pop() != pairs[c]:
                return False
    return not stack
''',
    "common_prefix": '''
import os

def common_prefix(words):
    return os.path.commonprefix(words)
''',
    "pair_with_sum": '''
def pair_with_sum(nums, target):
    first = {}
    for j, x in enumerate(nums):
        if target - x in first:
            return (first[target - x], j)
        first.setdefault(x, j)
    return None
''',
    "running_max": '''
from itertools import accumulate

def running_max(nums):
    return list(accumulate(nums, max))
''',
    "count_islands": '''
def count_islands(grid):
    seen = set()
    count = 0
    for r, row in enumerate(grid):
        for c, cell in enumerate(row):
            if cell == 1 and (r, c) not in seen:
                count += 1
                stack = [(r, c)]
                seen.add((r, c))
                while stack:
                    y, x = stack.pop()
                    for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                        if 0 <= ny < len(grid) and 0 <= nx < len(grid[0]) and grid[ny][nx] == 1 \\
                                and (ny, nx) not in seen:
                            seen.add((ny, nx))
                            stack.append((ny, nx))
    return count
''',
    "pascal_row": '''
def pascal_row(n):
    row = [1]
    for _ in range(n):
        row = [1] + [a + b for a, b in zip(row, row[1:])] + [1]
    return row
''',
    "snake_to_camel": '''
def snake_to_camel(name):
    pieces = [p for p in name.split("_") if p]
    if not pieces:
        return ""
    return pieces[0].lower() + "".join(p[0].upper() + p[1:].lower() for p in pieces[1:])
''',
    "second_largest": '''
def second_largest(nums):
    distinct = sorted(set(nums))
    return distinct[-2] if len(distinct) >= 2 else None
''',
    "spiral_order": '''
def spiral_order(matrix):
    rows = [list(row) for row in matrix]
    out = []
    while rows:
        out += rows.pop(0)
        rows = [list(col) for col in zip(*rows)][::-1]
    return out
''',
    "wrap_words": '''
def wrap_words(text, width):
    lines = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines
''',
}


@pytest.fixture(scope="module")
def problems():
    return load_problems()


def test_workload_has_32_distinct_problems_with_4_to_8_asserts(problems):
    assert len(problems) == 32
    assert len({p.id for p in problems}) == 32
    for p in problems:
        lines = p.tests.splitlines()
        assert 4 <= len(lines) <= 8, p.id
        assert all(line.startswith("assert ") and f"{p.entry_point}(" in line for line in lines), p.id
        assert f"`{p.entry_point}(" in p.prompt, p.id


def test_every_problem_passes_with_its_reference_solution(problems):
    assert set(REFERENCE) == {p.id for p in problems}
    failures = {p.id: v.reason for p in problems
                if not (v := run_tests(REFERENCE[p.id], p.tests, p.entry_point)).passed}
    assert failures == {}


@pytest.mark.slow
@pytest.mark.parametrize("stub", ["return None", "return args[0] if args else None"])
def test_every_problem_fails_with_a_wrong_stub(problems, stub):
    passing = [p.id for p in problems
               if run_tests(f"def {p.entry_point}(*args, **kwargs):\n    {stub}\n", p.tests, p.entry_point).passed]
    assert passing == []


def test_limit_takes_the_first_problems(problems):
    assert [p.id for p in load_problems(3)] == [p.id for p in problems[:3]]


# -- extraction ---------------------------------------------------------------------------------------------

def test_extracts_the_first_python_block():
    answer = ("Here is the function:\n\n```python\ndef f(x):\n    return x + 1\n```\n\nExample:\n\n"
              "```python\nprint(f(1))\n```\n")
    assert extract_code(answer) == "def f(x):\n    return x + 1\n"


def test_prefers_a_python_block_over_an_earlier_other_block():
    answer = "Run:\n```bash\npip install nothing\n```\nthen\n```py\ndef f():\n    pass\n```"
    assert extract_code(answer) == "def f():\n    pass\n"


def test_takes_a_block_without_language_when_there_is_no_python_block():
    answer = "Sure.\n```\ndef g():\n    return 2\n```\nDone."
    assert extract_code(answer) == "def g():\n    return 2\n"


def test_a_block_cut_off_by_the_token_limit_runs_to_the_end():
    assert extract_code("```python\ndef h():\n    return [1,") == "def h():\n    return [1,"


def test_a_closing_fence_on_the_code_line_ends_the_block():
    assert extract_code("```Python\ndef k(): return 3```") == "def k(): return 3"


def test_an_answer_without_fences_is_all_code():
    answer = "def f(x):\n    return x\n"
    assert extract_code(answer) == answer


SELF_CHECKED = """import re
from functools import cache

LIMIT = 10

@cache
def add(a: int, b: int) -> int:
    return a + b

def check():
    assert add(1, 1) == 3, "wrong expectation"

check()
print(add(2, 2))
if __name__ == "__main__":
    check()
"""


def test_keep_definitions_drops_the_answers_own_checks_and_demos():
    assert keep_definitions(SELF_CHECKED) == (
        "import re\nfrom functools import cache\nLIMIT = 10\n@cache\ndef add(a: int, b: int) -> int:\n"
        "    return a + b\ndef check():\n    assert add(1, 1) == 3, \"wrong expectation\"\n")


def test_keep_definitions_leaves_code_that_does_not_parse_alone():
    assert keep_definitions("def f(:\n    pass\n") == "def f(:\n    pass\n"
    assert keep_definitions("print(1)\n") == ""


def test_a_right_function_passes_whatever_its_own_checks_say():
    answer = f"Here you go:\n```python\n{SELF_CHECKED}```\nIt adds."
    problem = Problem("add", "", "add", TESTS)
    assert run_tests(extract_code(answer), TESTS, "add").reason.startswith("the code raised AssertionError")
    graded = grade(Attempt("add", "specdecode", answer, 9, "stop"), problem)
    assert (graded.passed, graded.reason) == (True, "passed")


# -- running ------------------------------------------------------------------------------------------------

TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"


def test_a_right_solution_passes():
    assert run_tests("def add(a, b):\n    return a + b\n", TESTS, "add").passed


def test_a_wrong_solution_fails_naming_the_assert_and_what_it_got():
    verdict = run_tests("def add(a, b):\n    return a - b\n", TESTS, "add")
    assert not verdict.passed
    assert verdict.reason == "failed: assert add(1, 2) == 3 (got -1)"


def test_what_the_solution_prints_does_not_confuse_the_verdict():
    code = "import sys\ndef add(a, b):\n    print('passed', end='')\n    return a * b\nprint('passed')\n"
    verdict = run_tests(code, TESTS, "add")
    assert not verdict.passed and verdict.reason.startswith("failed: assert add(1, 2) == 3")


def test_an_exception_in_a_test_is_a_one_line_failure():
    verdict = run_tests("def add(a, b):\n    raise ValueError('no\\nway')\n", TESTS, "add")
    assert not verdict.passed
    assert verdict.reason == "assert add(1, 2) == 3 raised ValueError: no way"


def test_code_that_does_not_compile_or_lacks_the_function_fails():
    broken = run_tests("def add(a, b)\n    return a + b\n", TESTS, "add")
    assert not broken.passed and broken.reason.startswith("the code raised SyntaxError")
    missing = run_tests("def plus(a, b):\n    return a + b\n", TESTS, "add")
    assert not missing.passed and missing.reason == "the code defines no function add"


def test_a_solution_that_exits_early_fails():
    verdict = run_tests("import os\ndef add(a, b):\n    os._exit(0)\n", TESTS, "add")
    assert not verdict.passed


def test_a_solution_that_never_ends_times_out():
    verdict = run_tests("def add(a, b):\n    while True:\n        pass\n", TESTS, "add", timeout=1)
    assert verdict == type(verdict)(False, "timed out after 1 s")


def test_the_solution_has_no_network():
    code = ("import socket\ndef add(a, b):\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
            "    return a + b\n")
    verdict = run_tests(code, TESTS, "add")
    assert not verdict.passed and "raised OSError" in verdict.reason


# -- llama.cpp ----------------------------------------------------------------------------------------------

PERF_LOG = """\
common_perf_print:    sampling time =       3.10 ms
common_perf_print: prompt eval time =     317.34 ms /    36 tokens (    8.82 ms per token,   113.44 tokens per second)
common_perf_print:        eval time =     293.11 ms /    15 runs   (   19.54 ms per token,    51.18 tokens per second)
"""


@pytest.fixture
def fake_completion(tmp_path):
    """Stand-in llama.cpp binaries: llama-completion records its arguments and prints record/stdout, then the
    perf print on stderr."""
    record, folder = tmp_path / "record", tmp_path / "bin"
    record.mkdir()
    folder.mkdir()
    (record / "err").write_text(PERF_LOG)
    for name in REQUIRED:
        script = folder / name
        script.write_text(f"""#!/bin/sh
printf '%s\\n' "$@" > "{record}/args"
cat "{record}/stdout"; cat "{record}/err" >&2
""")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return LlamaCpp(folder), record


@pytest.mark.skipif(sys.platform == "win32", reason="the stand-in binaries are shell scripts")
def test_llama_cpp_answers_stop_at_end_of_text(fake_completion, tmp_path):
    peer, record = fake_completion
    (record / "stdout").write_text("```python\ndef f():\n    return 1\n```\n [end of text]\n\n\n")
    attempt = answer_llama(peer, tmp_path / "m.gguf", "p", "<prompt>", prompt_tokens=36, max_tokens=512)
    assert (attempt.answer, attempt.tokens, attempt.finish_reason) == ("```python\ndef f():\n    return 1\n```\n",
                                                                       16, "stop")
    args = (record / "args").read_text().split("\n")
    assert "--ignore-eos" not in args and "-no-cnv" in args and "--no-display-prompt" in args
    assert args[args.index("-n") + 1] == "512" and args[args.index("--temp") + 1] == "0"

    (record / "stdout").write_text("def f():\n    return [1,\n\n")
    attempt = answer_llama(peer, tmp_path / "m.gguf", "p", "<prompt>", prompt_tokens=36, max_tokens=16)
    assert (attempt.answer, attempt.finish_reason) == ("def f():\n    return [1,", "length")


# -- report -------------------------------------------------------------------------------------------------

def _attempts():
    p = [Problem("a", "", "f", ""), Problem("b", "", "g", ""), Problem("c", "", "h", "")]
    ours = [Attempt("a", "specdecode", "x", 3, "stop", True, "passed"),
            Attempt("b", "specdecode", "y", 3, "stop", False, "failed: assert g() == 1 | 2"),
            Attempt("c", "specdecode", "z", 3, "length", True, "passed")]
    theirs = [Attempt("a", "llama.cpp", "x", 3, "stop", True, "passed"),
              Attempt("b", "llama.cpp", "y", 3, "stop", False, "failed: assert g() == 1 | 2"),
              Attempt("c", "llama.cpp", "w", 3, "stop", False, "timed out after 5 s")]
    return p, ours + theirs


def test_summary_counts_passes_differences_and_same_answers():
    problems, attempts = _attempts()
    summary = summarize(problems, attempts)
    assert summary["passed"] == {"specdecode": 2, "llama.cpp": 1}
    assert summary["verdicts_differ"] == 1 and summary["same_answers"] == 2 and summary["within_one"]
    assert summarize(problems, attempts[:3])["passed"] == {"specdecode": 2}


def test_report_writes_json_and_a_markdown_table(tmp_path):
    problems, attempts = _attempts()
    result = {"model": "m.gguf", "cpu": "cpu", "threads": 1, "max_tokens": 512, "llama_cpp": "bin",
              "formats": {"specdecode": "gguf weights, float32", "llama.cpp": "Q8_0"},
              "summary": summarize(problems, attempts), "attempts": [dataclasses.asdict(a) for a in attempts]}
    paths = write_report(result, tmp_path / "out")
    assert json.loads(paths["results"].read_text())["summary"]["verdicts_differ"] == 1
    report = paths["report"].read_text()
    assert report == render_markdown(result)
    assert "| specdecode | gguf weights, float32 | 2/3 | 66.7% |" in report
    assert "| b | fail: failed: assert g() == 1 \\| 2 | fail: failed: assert g() == 1 \\| 2 | yes |" in report
    assert "| c | pass | fail: timed out after 5 s | no |" in report


def test_cli_parses_bench_code():
    args = build_parser().parse_args(["bench", "code", "--model", "m.gguf", "--llama-cpp", "bin", "--threads", "2",
                                      "--limit", "2", "--out", "o"])
    assert (args.model, str(args.llama_cpp), args.threads, args.limit, str(args.out), args.max_tokens) == \
        ("m.gguf", "bin", 2, 2, "o", 512)
