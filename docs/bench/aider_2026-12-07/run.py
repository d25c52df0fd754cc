# Record: how docs/bench/aider_2026-12-07 was made (see README.md there).
"""aider end to end against `specdecode serve`: aider (installed from PyPI into a venv of its own) asked to make one
edit to a small file, in its "whole" and "diff" edit formats, non-interactively; the server's own time-to-first-token
histogram (/metrics) gives each request's wait, and the edit is checked in the file.

    python docs/bench/aider_2026-12-07/run.py --aider /tmp/aider-venv/bin/aider [--port 8940] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

FILE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
'''
ASK = "Add a docstring to perimeter that says what it returns. Change nothing else."
MODEL = "qwen2.5-coder-1.5b-instruct"


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name} ([0-9.e+-]+)$", text, re.M))


def run_aider(aider: str, url: str, edit_format: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix="aider-"))
    (work / "shapes.py").write_text(FILE)
    env = {**os.environ, "OPENAI_API_KEY": "none", "OPENAI_API_BASE": url + "/v1", "AIDER_ANALYTICS": "false"}
    before = (metric(url, "specdecode:time_to_first_token_seconds_sum"),
              metric(url, "specdecode:time_to_first_token_seconds_count"))
    start = time.perf_counter()
    proc = subprocess.run([aider, "--model", f"openai/{MODEL}", "--edit-format", edit_format, "--no-git",
                           "--yes-always", "--no-show-model-warnings", "--no-check-update", "--no-analytics",
                           "--map-tokens", "0", "--message", ASK, "shapes.py"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    after = (metric(url, "specdecode:time_to_first_token_seconds_sum"),
             metric(url, "specdecode:time_to_first_token_seconds_count"))
    requests = after[1] - before[1]
    edited = (work / "shapes.py").read_text()
    result = {"edit_format": edit_format, "wall_s": round(wall, 1), "requests": requests,
              "mean_ttft_s": round((after[0] - before[0]) / requests, 2) if requests else None,
              "exit": proc.returncode, "edited": edited != FILE,
              "perimeter_docstring": bool(re.search(r'def perimeter\(width, height\):\n\s+("""|\'\'\')', edited)),
              "area_unchanged": "def area(width, height):\n    \"\"\"The area of a rectangle.\"\"\"" in edited}
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aider", required=True)
    parser.add_argument("--port", type=int, default=8940)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--port", str(args.port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in server.stdout:
            if "ready at" in line:
                print(line.strip(), flush=True)
                break
        threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()  # (drain the log)
        results = [run_aider(args.aider, url, fmt) for fmt in ("whole", "diff")]
    finally:
        server.terminate()
        server.wait(timeout=60)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
