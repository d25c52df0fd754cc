"""`specdecode bench fim` without llama.cpp: the edits are cut from stdlib modules as described (deterministically),
every configuration of ours fills each middle exactly as our plain decoding does, and the report says so."""
import json
import sys

import pytest

from specdecode.bench import fim as fim_bench
from specdecode.bench.fim import KINDS, STDLIB_FILES, Edit, Row, make_edits, render_markdown, summarize, stdlib_dir
from specdecode.cli import main
from specdecode.model.tokenizer import Tokenizer
from tests.engine.fim_fixtures import fim_models  # noqa: F401 (fixture)


def test_edits_are_spans_of_stdlib_modules_one_kind_after_another(fim_models):
    tok = Tokenizer(fim_models["target"])
    edits = make_edits(6, tok, max_middle_tokens=400)
    assert [e.kind for e in edits] == list(KINDS) * 2 and len({e.file for e in edits}) == 6
    assert [e.file for e in edits] == [f for f in STDLIB_FILES if (stdlib_dir() / f).is_file()][:6]
    for edit in edits:
        source = (stdlib_dir() / edit.file).read_text()
        if edit.kind != "rename":  # the file is prefix + middle + suffix, each side cut to its window of lines
            assert edit.prefix + edit.middle + edit.suffix in source
        else:
            new = next(w for w in edit.middle.replace("(", " ").replace(")", " ").split() if w.endswith("_value"))
            old = new.removesuffix("_value")
            assert f"{new}" in edit.prefix.splitlines()[-1] or any(new in line for line in edit.prefix.splitlines())
            assert edit.middle.replace(new, old) in source and edit.files[0][1] in source
            assert new not in edit.files[0][1]  # the function as it was before the rename
        assert edit.middle.strip() and edit.suffix.startswith("\n") and edit.prefix.endswith("\n")
    assert make_edits(6, tok, max_middle_tokens=400) == edits  # the same edits every time


def test_every_configuration_fills_the_middle_as_plain_decoding(fim_models, tmp_path, monkeypatch):
    """(Tiny edits: the tiny model's context is 512 positions of a character-level vocabulary.)"""
    edits = [Edit("a:body:1-2", "body", "a.py", "def add(a, b):\n", "    return a + b", "\n\nprint(add(1, 2))\n"),
             Edit("b:rename:1-2", "rename", "b.py", "def f(x_value):\n", "    return x_value * 2", "\n",
                  [("b_before_rename.py", "def f(x):\n    return x * 2\n")])]
    monkeypatch.setattr(fim_bench, "make_edits", lambda count, tokenizer, cap: edits[:count])
    monkeypatch.setattr(fim_bench, "stdlib_dir", lambda: tmp_path)
    for edit in edits:
        (tmp_path / edit.file).write_text(edit.prefix + edit.middle + edit.suffix)
    out = tmp_path / "fim"
    code = main(["bench", "fim", "--model", str(fim_models["target"]), "--draft", str(fim_models["draft"]),
                 "--edits", "2", "--max-tokens", "12", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    assert [r["engine"] for r in result["summary"]] == ["specdecode plain", "specdecode ngram", "specdecode auto"]
    assert all(r["same_as_plain"] == 2 for r in result["summary"])
    assert set(result["files_sha256"]) == {"a.py", "b.py"}
    assert "| specdecode auto |" in (out / "report.md").read_text()


def test_summary_counts_exact_middles_and_identity_with_plain():
    rows = [Row("specdecode plain", "e1", "body", 10, 10.0, True, token_ids=[1, 2]),
            Row("specdecode ngram", "e1", "body", 10, 20.0, True, True, 8, 6, token_ids=[1, 2]),
            Row("specdecode plain", "e2", "lines", 10, 10.0, False, token_ids=[3]),
            Row("specdecode ngram", "e2", "lines", 10, 15.0, False, True, 4, 0, token_ids=[4])]
    summary = {r["engine"]: r for r in summarize(rows)}
    assert summary["specdecode ngram"]["same_as_plain"] == 1 and summary["specdecode ngram"]["exact"] == 1
    assert summary["specdecode ngram"]["ratio"] == pytest.approx(1.75) and summary["specdecode ngram"]["acceptance"] \
        == pytest.approx(0.5)
    edits = [{"same_tokens_in_llama_cpp": True}] * 2
    table = render_markdown({"model": "m", "draft": "d", "cpu": "cpu", "threads": 1, "edits": edits,
                             "files_sha256": {"a": ""}, "stdlib": sys.prefix, "max_tokens": 8,
                             "num_speculative_tokens": 8, "summary": summarize(rows)})
    assert "| specdecode ngram | 1/2 | 1/2 |" in table and "equal ours on 2/2 edits" in table
