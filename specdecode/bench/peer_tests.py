"""llama.cpp's own server test suite (tools/server/tests, pytest) run against `specdecode serve`: `specdecode bench
peer-tests`. The suite comes from the llama-cpp-python sdist (pinned, checked by sha256), its Python requirements go
into a venv of their own (pinned), and its ServerProcess starts a launcher (LLAMA_SERVER_BIN_PATH) that maps
llama-server's flags onto `specdecode serve`. Every test's outcome is classified from CLASSES_FILE (test id -> class
and reason): passed, model-dependent, deliberate difference, not supported, protocol (a difference still to fix).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from specdecode.catalog.registry import sha256_file

SDIST = "llama-cpp-python==0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SUITE_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/tests"
"""Where the suite lies in the sdist."""
REQUIREMENTS = ("pytest==8.3.5", "filelock==3.16.1", "requests==2.32.5", "wget==3.2", "openai==2.14.0")
"""What the unit files run here import (the suite's requirements.txt, pinned within its ~= ranges; aiohttp, numpy,
prometheus-client and pytest-xdist are imported by none of them)."""
UNIT_FILES = ("test_basic", "test_security", "test_completion", "test_chat_completion", "test_infill",
              "test_tokenize", "test_metrics", "test_ctx_shift", "test_stream", "test_ignore_eos", "test_template")
"""The suite's files about what specdecode serves (generation, its routes, auth, metrics); the others test features
it has no counterpart of (embeddings, rerank, lora, router, slot save, vision, MCP, tools built in, Anthropic's API)."""
CLASSES_FILE = Path(__file__).parent / "workloads" / "peer_tests_classes.json"
"""{test id: {"class": ..., "reason": ...}} for every test that does not pass, and why."""
CLASSES = ("passed", "model-dependent", "deliberate", "not-supported", "protocol")
"""passed; model-dependent: fails only because the suite's tiny story model writes other text (or counts other
tokens); deliberate: a difference kept on purpose (docs/serving.md says why); not-supported: a feature specdecode
lacks; protocol: a difference still to fix."""
DEFAULT_MODEL = "smollm2-135m-instruct"
BLOCK = 16

PLUGIN = '''"""Loaded into llama.cpp's suite by specdecode bench peer-tests: no model downloads (the launcher serves its own
model), and a test that hangs fails after PEER_TEST_TIMEOUT seconds instead of stalling the run."""
import os
import signal

import pytest


def pytest_sessionstart(session):
    import utils
    utils.ServerPreset.load_all = staticmethod(lambda: None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    def expired(signum, frame):
        raise TimeoutError("the test ran past PEER_TEST_TIMEOUT")
    signal.signal(signal.SIGALRM, expired)
    signal.alarm(int(os.environ.get("PEER_TEST_TIMEOUT", "120")))
    try:
        yield
    finally:
        signal.alarm(0)
'''


# -- the launcher: llama-server's command line -> specdecode serve's ----------------------------------------------

def launcher_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama-server (specdecode)", add_help=False, allow_abbrev=False)
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--parallel", "-np", type=int, default=1)
    p.add_argument("--ctx-size", "-c", type=int, default=None)
    p.add_argument("--alias", "-a", default=None)
    p.add_argument("--threads", "-t", type=int, default=None)
    p.add_argument("--cors-origins", default=None)
    p.add_argument("--slots", dest="slots", action="store_true")
    p.add_argument("--no-slots", dest="slots", action="store_false")
    return p


def serve_args(argv: list[str], model: str, threads: int = 1) -> list[str]:
    """`specdecode serve` arguments for a llama-server command line: --port, --host, --api-key, --parallel ->
    --max-num-seqs, --ctx-size / parallel -> --max-model-len, --alias -> --served-model-name, --cors-origins; model
    flags (--hf-repo, --model, ...), sampling defaults and llama.cpp's tuning flags are not ours and are dropped."""
    known, _ = launcher_parser().parse_known_args(argv)
    parallel = max(1, known.parallel)
    args = ["serve", "--model", model, "--port", str(known.port), "--host", known.host,
            "--max-num-seqs", str(parallel), "--threads", str(known.threads or threads), "--log-level", "warning"]
    if known.ctx_size:
        per_slot = max(2, known.ctx_size // parallel)
        # a pool for the slots and as much again for the prefix cache: the server's default plan takes GBs
        args += ["--max-model-len", str(per_slot), "--num-kv-blocks", str(2 * parallel * (-(-per_slot // BLOCK)))]
    if known.api_key:
        args += ["--api-key", known.api_key]
    if known.alias:
        args += ["--served-model-name", known.alias]
    if known.cors_origins:
        args += ["--cors-origins", known.cors_origins]
    return args


def launch(argv: list[str]) -> int:
    """The launcher's body: becomes `specdecode serve` (exec, so that the suite's terminate() reaches it)."""
    model = os.environ.get("PEER_TESTS_MODEL", DEFAULT_MODEL)
    args = serve_args(argv, model, int(os.environ.get("PEER_TESTS_THREADS", "1")))
    print("launcher: specdecode " + " ".join(args), flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "specdecode.cli", *args])
    return 1  # not reached


# -- fetching and installing the suite ------------------------------------------------------------------------------

def fetch_suite(work: Path, python: str = sys.executable) -> Path:
    """The suite's directory, unpacked from the pinned sdist (downloaded with pip once, checked by sha256)."""
    suite = work / SUITE_DIR
    if (suite / "utils.py").exists():
        return suite
    sdist = work / SDIST_FILE
    if not sdist.exists():
        subprocess.run([python, "-m", "pip", "download", SDIST, "--no-binary", ":all:", "--no-deps", "-d", str(work)],
                       check=True)
    found = sha256_file(sdist)
    if found != SDIST_SHA256:
        raise RuntimeError(f"{sdist} has sha256 {found}, not the pinned {SDIST_SHA256}; delete it and retry")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(SUITE_DIR + "/")]
        tar.extractall(work, members=members, filter="data")
    return suite


def suite_python(work: Path) -> Path:
    """A venv of the suite's own requirements (REQUIREMENTS), created once."""
    venv = work / "venv"
    python = venv / "bin" / "python"
    marker = venv / "requirements.txt"
    wanted = "\n".join(REQUIREMENTS) + "\n"
    if python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *REQUIREMENTS], check=True)
    marker.write_text(wanted)
    return python


def write_launcher(suite: Path) -> Path:
    """The executable the suite starts in place of llama-server, and the plugin that the run loads."""
    launcher = suite / "specdecode-llama-server"
    launcher.write_text(f"#!{sys.executable}\nimport sys\nfrom specdecode.bench.peer_tests import launch\n"
                        "sys.exit(launch(sys.argv[1:]))\n")
    launcher.chmod(0o755)
    (suite / "specdecode_peer_plugin.py").write_text(PLUGIN)
    return launcher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- running and classifying ----------------------------------------------------------------------------------------

def run_suite(suite: Path, python: Path, out: Path, targets: list[str], model: str, select: str | None = None,
              threads: int = 1, test_timeout: int = 120) -> Path:
    """Run the suite's fast tier (-m "not slow", as its tests.sh does without SLOW_TESTS) of `targets` (unit file
    names, or test ids: unit/test_x.py::name); returns the junit xml."""
    out.mkdir(parents=True, exist_ok=True)
    junit = out / "junit.xml"
    launcher = write_launcher(suite)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(launcher), "PORT": str(free_port()),
           "PEER_TESTS_MODEL": model, "PEER_TESTS_THREADS": str(threads), "PEER_TEST_TIMEOUT": str(test_timeout),
           "SLOW_TESTS": "0"}
    command = [str(python), "-m", "pytest", "-p", "specdecode_peer_plugin", "-m", "not slow", "-rA", "-q",
               "-o", "junit_family=xunit1", f"--junitxml={junit}",
               *(t if "::" in t else f"unit/{t}.py" for t in targets)]
    if select:
        command += ["-k", select]
    with open(out / "pytest.log", "w") as log:
        subprocess.run(command, cwd=suite, env=env, stdout=log, stderr=subprocess.STDOUT)
    return junit


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test id (unit/test_x.py::name[params]) -> (passed | failed | skipped, first line of the failure)."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        test_id = f"{path}::{case.get('name')}"
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                status = "skipped" if tag == "skipped" else "failed"
                message = (element.get("message") or "").splitlines()[0][:200] if element.get("message") else ""
                break
        found[test_id] = (status, message)
    return found


def classify(results: dict[str, tuple[str, str]], classes: dict[str, dict]) -> dict[str, dict]:
    """Each test's class: passed when it passed, else its entry of the table (unclassified when it has none)."""
    table = {}
    for test_id, (status, message) in sorted(results.items()):
        if status == "skipped":
            table[test_id] = {"class": "skipped", "reason": message}
        elif status == "passed":
            table[test_id] = {"class": "passed", "reason": ""}
        else:
            entry = classes.get(test_id, {"class": "unclassified", "reason": ""})
            table[test_id] = {**entry, "failure": message}
    return table


def counts(table: dict[str, dict]) -> dict[str, int]:
    tally = {name: 0 for name in CLASSES}
    for entry in table.values():
        tally[entry["class"]] = tally.get(entry["class"], 0) + 1
    return {name: n for name, n in tally.items() if n or name in CLASSES}


def stale(table: dict[str, dict], classes: dict[str, dict]) -> list[str]:
    """Tests the table explains that now pass (the table should lose them)."""
    return [test_id for test_id, entry in table.items() if entry["class"] == "passed" and test_id in classes]


def cmd_peer_tests(args) -> int:
    from specdecode.hardware import cpu_name

    work = args.work_dir.expanduser()
    work.mkdir(parents=True, exist_ok=True)
    suite = fetch_suite(work)
    python = suite_python(work)
    start = time.time()
    files = args.files.split(",") if args.files else list(UNIT_FILES)
    junit = run_suite(suite, python, args.out, files, args.model, args.select, args.threads, args.test_timeout)
    elapsed = time.time() - start
    classes = json.loads(CLASSES_FILE.read_text())
    table = classify(outcomes(junit), classes)
    tally = counts(table)
    report = {"command": "specdecode bench peer-tests " + " ".join(sys.argv[3:]), "suite": SDIST, "model": args.model,
              "cpu": cpu_name(), "seconds": round(elapsed), "counts": tally, "tests": table}
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"llama.cpp's server tests ({SDIST}, fast tier, {len(table)} tests of {len(files)} files) against "
          f"specdecode serve --model {args.model}: {elapsed:.0f} s on {cpu_name()}")
    for name, n in tally.items():
        print(f"  {name:16} {n}")
    for test_id, entry in table.items():
        if entry["class"] in ("unclassified", "protocol") and args.verbose:
            print(f"  {entry['class']}: {test_id}: {entry.get('failure', '')}")
    for test_id in stale(table, classes):
        print(f"  passes now, still in {CLASSES_FILE.name}: {test_id}")
    print(f"wrote {args.out / 'results.json'} (junit.xml and pytest.log beside it)")
    return 0
