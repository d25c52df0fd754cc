"""Every example in README.md and docs/*.md runs as written against the default server (the stand-in of conftest:
the default model's name, names checked strictly): each `curl` line is run by curl with only the address changed,
each Python block that talks to the server is executed with only its base_url changed, each Python block of the
offline API is executed with LLM building the tiny model in place of the named or placeholder one (every other
argument as written), and every `specdecode ...` command line must parse (its flags exist, its values are valid;
placeholders in capitals stand for any value)."""
import contextlib
import io
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

import specdecode
from specdecode.catalog.registry import DEFAULT_MODEL, shipped_speculator
from specdecode.cli.main import build_parser
from specdecode.engine.llm import LLM

from .conftest import openai_stream, sse_data

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCUMENTED_ADDRESS = "http://127.0.0.1:8000"


def blocks(language: str) -> list[tuple[str, str]]:
    """(where, text) of every fenced block of that language: "README.md:132"."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if match.group(1) == language:
                line = text[:match.start()].count("\n") + 1
                found.append((f"{page.relative_to(ROOT)}:{line}", match.group(2)))
    return found


def commands(text: str) -> list[str]:
    """The shell commands of a block, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


CURLS = [(where, cmd) for where, text in blocks("bash") for cmd in commands(text) if cmd.startswith("curl ")]
SPECDECODE = [(where, cmd) for where, text in blocks("bash") for cmd in commands(text)
              if cmd.startswith("specdecode ")]
PYTHON = blocks("python")


def test_the_pages_hold_the_examples_this_test_runs():
    assert len(CURLS) >= 3 and len(PYTHON) >= 5 and len(SPECDECODE) >= 30
    assert any("clients.md" in where for where, _ in CURLS + PYTHON), "docs/clients.md's recipes are examples too"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("where, command", CURLS, ids=[w for w, _ in CURLS])
def test_curl_examples(served, where, command):
    assert DOCUMENTED_ADDRESS in command, f"{where}: the example should use the default address"
    args = shlex.split(command.replace(DOCUMENTED_ADDRESS, served.url), comments=True)
    done = subprocess.run(args + ["--silent", "--show-error", "--write-out", "\n%{http_code}"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"{where}: {done.stderr}"
    body, status = done.stdout.rsplit("\n", 1)
    assert status == "200", f"{where}: {status} {body}"
    if '"stream": true' in command:
        chunks = openai_stream(sse_data(body.splitlines()))
        assert chunks and all(c["object"].endswith(".chunk") for c in chunks)
    elif "completions" in command:
        assert json.loads(body)["choices"], f"{where}: no choices"
    else:
        json.loads(body)  # llama.cpp's routes and the others answer JSON


def run_python(where: str, source: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, where, "exec"), {"__name__": "__docs__"})
    return out.getvalue()


@pytest.mark.parametrize("where, source", [(w, s) for w, s in PYTHON if "OpenAI(" in s],
                         ids=[w for w, s in PYTHON if "OpenAI(" in s])
def test_openai_client_examples(served, where, source):
    assert f'base_url="{DOCUMENTED_ADDRESS}/v1"' in source, f"{where}: the example should use the default address"
    printed = run_python(where, source.replace(DOCUMENTED_ADDRESS, served.url))
    assert printed.strip(), f"{where} printed nothing"


@pytest.fixture
def tiny_llm(monkeypatch, chat_target, fim_models):
    """LLM(...) as the examples call it, building the tiny chat model (and its draft, where a draft is named). A
    head-based method without a speculator named must have one shipped for the named (or default) model; the tiny
    model then drafts by prompt lookup in its place."""
    def build(model=None, speculative_config=None, dtype=None, **kwargs):
        config = dict(speculative_config or {})
        if config.get("method") in ("eagle", "medusa") and "model" not in config:
            named = model or DEFAULT_MODEL
            assert shipped_speculator(named, config["method"]) is not None, \
                f"no {config['method']} speculator ships for {named}: the example cannot run as written"
            config = {"method": "ngram", "num_speculative_tokens": config.get("num_speculative_tokens", 4)}
        elif "model" in config:
            config["model"] = str(fim_models["draft"])
        return LLM(chat_target, dtype="float32", speculative_config=config or None, **kwargs)
    monkeypatch.setattr(specdecode, "LLM", build)


@pytest.mark.parametrize("where, source", [(w, s) for w, s in PYTHON if "OpenAI(" not in s],
                         ids=[w for w, s in PYTHON if "OpenAI(" not in s])
def test_offline_api_examples(tiny_llm, where, source):
    run_python(where, source.replace("max_tokens=128", "max_tokens=16"))


PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$")
PATH = re.compile(r"^(~|/|path/to)|/$|\.(gguf|jsonl?|txt)$|^[A-Z_]*(DIR|PATH|FILE)$")


@pytest.mark.parametrize("where, command", SPECDECODE, ids=[f"{w} {c[:40]}" for w, c in SPECDECODE])
def test_command_lines_parse(where, command, capsys, tmp_path):
    """Placeholders and paths of the writer's machine stand for a value that exists here: a path (an empty folder)
    or the number 1."""
    args = []
    for arg in shlex.split(command, comments=True)[1:]:
        if not arg.startswith("-") and PATH.search(arg):
            arg = str(tmp_path)
        elif PLACEHOLDER.match(arg):
            arg = "1"
        args.append(arg)
    try:
        build_parser().parse_args(args)
    except SystemExit as exc:
        if exc.code != 0:  # 0: --help
            pytest.fail(f"{where}: `{command}` does not parse: {capsys.readouterr().err.strip()}")
