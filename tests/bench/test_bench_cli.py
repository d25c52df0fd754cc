"""`specdecode bench --quick` end to end on tiny checkpoints and a workload file: the files it writes and that
their figures are consistent with each other (never with the clock)."""
import json

import pytest

from specdecode.bench.bench import BenchConfig, compare_peers, load_prompts, sweep_prompt_ids
from specdecode.bench.sweep import fixed_k_stops_paying
from specdecode.cli import main
from specdecode.errors import ConfigError

MAX_TOKENS = 6
WORKLOADS = {"categories": {
    "code": ["def add(a, b):", {"messages": [{"role": "user", "content": "class Point:"}], "reference": "x"}],
    "chat": [{"messages": [{"role": "user", "content": "for i in range(10):"}, {"role": "assistant", "content": "ok"},
                           {"role": "user", "content": "import os"}]}]}}
METHODS = ("draft_model", "ngram", "lookahead", "auto")


@pytest.fixture(scope="module")
def bench_run(tiny_models, tmp_path_factory):
    # Fixed K: on tiny models measured costs may rightly tell adaptive rows never to draft, and these tests read
    # the drafting rows' acceptance figures.
    out = tmp_path_factory.mktemp("bench")
    workload = out / "workload.json"
    workload.write_text(json.dumps(WORKLOADS))
    code = main(["bench", "--quick", "--model", str(tiny_models["target"]), "--workload-file", str(workload),
                 "--speculative-model", str(tiny_models["draft"]), "--methods", ",".join(METHODS),
                 "--prompts", "2", "--max-tokens", str(MAX_TOKENS), "--max-prompt-tokens", "200",
                 "--temperatures", "0,1", "--batch-sizes", "1,2", "--sweep-ks", "2", "--sweep-max-tokens", "4",
                 "--num-speculative-tokens", "3", "--out", str(out), "--note", "test run", "--no-adaptive"])
    assert code == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_writes_results_report_and_plots(bench_run):
    out, _ = bench_run
    for name in ("report.md", "speedup.png", "batch_sweep.png", "accepted_length.png"):
        assert (out / name).stat().st_size > 0, name
    for name in ("speedup.png", "batch_sweep.png", "accepted_length.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_every_engine_runs_every_prompt_at_every_temperature(bench_run):
    _, results = bench_run
    engines = {"plain", *METHODS, "hf_plain", "hf_assisted", "hf_prompt_lookup"}
    assert set(results["per_request"]) == {"T=0", "T=1"}
    assert {c: len(p) for c, p in results["prompts"].items()} == {"code": 2, "chat": 1}
    for temperature, table in results["per_request"].items():
        assert set(table) == {"code", "chat", "all"}
        for category, rows in table.items():
            assert set(rows) == engines
            prompts = 3 if category == "all" else len(results["prompts"][category])
            for name, row in rows.items():
                assert row["prompts"] == prompts and 0 < row["tokens"] <= prompts * MAX_TOKENS, (category, name)
                if temperature == "T=0" and not name.startswith("hf_"):  # greedy speculation is exact
                    assert row["same_as_plain"] == prompts, (category, name)


def test_figures_are_consistent(bench_run):
    _, results = bench_run
    table = results["per_request"]["T=0"]
    rows = table["all"]
    for name, row in rows.items():
        plain = rows["hf_plain" if name.startswith("hf_") else "plain"]
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / plain["tokens_per_s"])
        assert row["vs_plain"] == pytest.approx(row["tokens_per_s"] / rows["plain"]["tokens_per_s"])
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
        assert row["tokens"] == sum(table[c][name]["tokens"] for c in ("code", "chat"))
        assert 0 <= row["latency_p50_s"] <= row["latency_p99_s"]
        assert row["cpu_s_per_million_tokens"] == pytest.approx(1e6 / row["tokens_per_cpu_s"])
    draft = rows["draft_model"]
    assert 1 <= draft["mean_accepted_len"] <= 4  # K = 3
    assert sum(draft["accepted_len_counts"]) > 0 and len(draft["accepted_len_counts"]) <= 4
    assert draft["draft_share"] + draft["verify_share"] + draft["other_share"] == pytest.approx(1)
    peers = results["peers"]["T=0"]["all"]["draft_model_vs_hf_assisted"]
    assert peers["tokens_per_s_ratio"] == pytest.approx(draft["tokens_per_s"] / rows["hf_assisted"]["tokens_per_s"])
    assert results["roofline"]["plain_tokens_per_s"] == rows["plain"]["tokens_per_s"]
    summaries = [r for r in results["sweep"] if r["mode"] == "summary"]
    assert [r["batch_size"] for r in summaries] == [1, 2]
    for s in summaries:
        assert s["goal_met"] == (s["adaptive_vs_best"] >= 0.98)
        assert s["cpu_goal_met"] == (s["cpu_adaptive_vs_best"] >= 0.98)
    assert {r["requests"] for r in results["sweep"] if r["mode"] == "plain"} == {8}  # 8 x 1, 4 x 2
    assert results["settings"]["num_speculative_tokens"] == 3 and results["settings"]["prompts"] == 2


def test_report_shows_the_measured_numbers(bench_run):
    out, results = bench_run
    report = (out / "report.md").read_text()
    rows = results["per_request"]["T=0"]["all"]
    assert f"| plain | {rows['plain']['tokens_per_s']:.1f} | 1.00x | 1.00x |" in report
    assert f"| prompt lookup | {rows['ngram']['tokens_per_s']:.1f} | {rows['ngram']['vs_plain']:.2f}x" in report
    assert f"{rows['plain']['cpu_s_per_million_tokens']:,.0f}" in report
    assert f"{100 * results['roofline']['share']:.0f}% of the ceiling" in report
    assert f"{results['machine']['torch_threads']} thread(s)" in report and "test run" in report
    for png in ("speedup.png", "batch_sweep.png", "accepted_length.png"):
        assert f"]({png})" in report
    sources = results["sources"]["auto"]  # auto's sources, counted
    assert set(sources) == {"ngram", "suffix"} and sum(c["proposed"] for c in sources.values()) > 0
    for source, c in sources.items():
        assert f"| auto (combined tree) | {source} | {c['proposed']} | {c['accepted']} |" in report


def test_compare_peers_ratios():
    rows = {"plain": {"tokens_per_s": 100.0, "speedup": 1.0}, "draft_model": {"tokens_per_s": 200.0, "speedup": 2.0},
            "ngram": {"tokens_per_s": 300.0, "speedup": 3.0}, "hf_plain": {"tokens_per_s": 50.0, "speedup": 1.0},
            "hf_assisted": {"tokens_per_s": 125.0, "speedup": 2.5}}
    out = compare_peers(rows)
    draft = out["draft_model_vs_hf_assisted"]
    assert draft["tokens_per_s_ratio"] == 1.6 and draft["their_speedup"] == 2.5
    assert draft["best_ours_ratio"] == 300.0 / 125.0
    assert out["plain_vs_hf_plain"]["tokens_per_s_ratio"] == 2.0
    assert "ngram_vs_hf_prompt_lookup" not in out


def test_sweep_helpers():
    assert sweep_prompt_ids({"a": [[1, 2, 3], [4]], "b": [[5, 6]]}, 2) == [[2, 3], [5, 6], [4]]
    rows = [{"batch_size": b, "mode": "summary", "best_fixed_vs_plain": v} for b, v in ((1, 1.3), (2, 0.9), (4, 1.01),
                                                                                         (8, 0.8), (16, 0.7))]
    assert fixed_k_stops_paying(rows) == 8
    assert fixed_k_stops_paying(rows[:3]) is None


def test_config_rejects_bad_input(tiny_models, capsys):
    with pytest.raises(ConfigError, match="unknown categor"):
        BenchConfig(model=str(tiny_models["target"]), categories=("poetry",), sweep_batch_sizes=())
    with pytest.raises(ConfigError, match="no speculator"):
        BenchConfig(model=str(tiny_models["target"]), sweep_method="eagle")
    config = BenchConfig(model=str(tiny_models["target"]), sweep_batch_sizes=())
    assert config.methods == ("ngram", "lookahead", "suffix")  # a path brings no shipped speculators
    assert main(["bench", "--model", str(tiny_models["target"] / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    # --speculative-model takes what --model takes (a name, a .gguf, a directory) and its error names it
    assert main(["bench", "--model", str(tiny_models["target"]), "--speculative-model", "nosuch-draft"]) == 2
    err = capsys.readouterr().err
    assert "--speculative-model nosuch-draft: no such file or directory" in err and "--model" not in err.replace(
        "--speculative-model", "")


def test_stdlib_workloads_are_raw_prompts(tiny_models):
    from specdecode.model.tokenizer import Tokenizer

    config = BenchConfig(model=str(tiny_models["target"]), stdlib_workloads=True, prompts=2, max_prompt_tokens=400,
                         sweep_batch_sizes=())
    tokenizer = Tokenizer(tiny_models["target"])
    prompts = load_prompts(config, tokenizer)
    assert set(prompts) <= {"completion", "grounded_edit", "docstring"} and prompts
    for ps in prompts.values():
        assert 1 <= len(ps) <= 2
        for p in ps:
            assert p.messages == [] and p.token_ids(tokenizer) == tokenizer.encode(p.text)


def test_fixed_too_adds_a_fixed_k_row_per_method(tiny_models, tmp_path):
    from specdecode.bench.report import _label

    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps(WORKLOADS))
    assert main(["bench", "--model", str(tiny_models["target"]), "--workload-file", str(workload), "--methods",
                 "ngram", "--fixed-too", "--no-peers", "--no-sweep", "--temperatures", "0", "--prompts", "1",
                 "--max-tokens", "4", "--max-prompt-tokens", "200", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["per_request"]["T=0"]["all"]
    assert list(rows) == ["plain", "ngram", "ngram fixed"]
    assert rows["ngram fixed"]["same_as_plain"] == rows["ngram fixed"]["prompts"] == 2
    assert "| prompt lookup, fixed K |" in (tmp_path / "report.md").read_text()
    assert _label("ngram fixed", {"ngram": "prompt lookup"}) == "prompt lookup, fixed K"
