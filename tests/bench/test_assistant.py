"""`specdecode bench assistant` on tiny models (no llama.cpp): the three categories are built as meant, every
configuration of ours answers each request exactly as our plain decoding does, and the report and plot are
written."""
import json

from specdecode.bench import assistant
from specdecode.bench.assistant import (CATEGORIES, EDIT_ASKS, FOLLOW_UPS, AssistantConfig, build_requests,
                                        render_markdown, run_assistant)
from specdecode.cli import main


def test_requests_cover_generation_edits_and_conversations():
    asked = []

    def answer(messages):
        asked.append(messages)
        return f"answer {len(asked)}"

    requests = build_requests(2, answer)
    assert [r.category for r in requests] == ["generate"] * 2 + ["edit"] * 2 + ["multi_turn"] * 2
    assert all(r.problem is not None for r in requests[:2])
    assert requests[2].messages[0]["content"].startswith(EDIT_ASKS[0]) and "```python\n" in requests[2].messages[0]["content"]
    turn3 = requests[-1].messages
    assert [m["role"] for m in turn3] == ["user", "assistant", "user", "assistant", "user"]
    assert [turn3[1]["content"], turn3[3]["content"]] == ["answer 1", "answer 2"]  # our own earlier answers
    assert [turn3[2]["content"], turn3[4]["content"]] == list(FOLLOW_UPS)
    assert requests[-2].messages == turn3[:3]
    edited = {r.messages[0]["content"] for r in requests if r.category == "edit"}
    assert turn3[0]["content"] not in edited  # the conversation refactors a function of its own


def test_every_configuration_answers_as_plain_decoding(tiny_models, tmp_path, monkeypatch):
    """(Short functions to edit: the tiny model's context is 512 positions of a character-level vocabulary.)"""
    monkeypatch.setattr(assistant, "functions", lambda count, skip=0: [f"def f{skip + i}(a, b):\n    return a + b\n"
                                                                       for i in range(count)])
    out = tmp_path / "assistant"
    code = main(["bench", "assistant", "--model", str(tiny_models["target"]), "--draft", str(tiny_models["draft"]),
                 "--prompts", "1", "--max-tokens", "12", "--dtype", "float32", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    rows = result["summary"]
    assert [r["engine"] for r in rows] == ["specdecode plain", "specdecode draft_model", "specdecode ngram",
                                           "specdecode auto"]
    for row in rows:
        assert row["same_as_plain"] == row["requests"] == 4, row  # 1 generate, 1 edit, 2 conversation turns
        assert row["reference"] == "specdecode plain" and all(row[c]["tokens_per_s"] > 0 for c in CATEGORIES)
    assert rows[0]["all"]["ratio"] == 1.0 and rows[0]["tests_passed"] == "0/1"  # a random model's code fails
    assert (out / "assistant.png").stat().st_size > 0
    assert "| specdecode auto |" in (out / "report.md").read_text() == render_markdown(result)


def test_write_run_times_the_run_and_writes_what_it_reports(tmp_path, capsys):
    """The one writer of `bench assistant` and `bench fim`: results.json (with the run's seconds), report.md, the
    extra files, and a line naming every file written."""
    import json

    from specdecode.bench.assistant import write_run

    def extra(result):
        (tmp_path / "out" / "plot.png").write_bytes(b"png")
        return [tmp_path / "out" / "plot.png"]

    assert write_run(tmp_path / "out", lambda: {"rows": [1, 2]}, lambda r: f"# {len(r['rows'])} rows\n", extra) == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["rows"] == [1, 2] and saved["seconds"] >= 0
    assert (tmp_path / "out" / "report.md").read_text() == "# 2 rows\n"
    printed = capsys.readouterr().out
    assert "# 2 rows" in printed and all(str(tmp_path / "out" / n) in printed for n in ("results.json", "report.md",
                                                                                          "plot.png"))
