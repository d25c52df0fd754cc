"""`specdecode bench --quick` end to end on tiny checkpoints: the files it writes and that they hold the run."""
import json

import pytest

from specdecode.bench.bench import BenchConfig, compare_peers
from specdecode.cli import main
from specdecode.errors import ConfigError

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def bench_run(tiny_models, tmp_path_factory):
    # Fixed K: on tiny models measured costs may rightly tell adaptive rows never to draft, and these tests read
    # the drafting rows' acceptance figures.
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--quick", "--model", str(tiny_models["target"]),
                 "--speculative-model", str(tiny_models["draft"]), "--prompts", "1", "--max-tokens", str(MAX_TOKENS),
                 "--batch-sizes", "1,2", "--sweep-ks", "2", "--num-speculative-tokens", "3", "--out", str(out),
                 "--note", "test run", "--no-adaptive"])
    assert code == 0
    return out, json.loads((out / "results.json").read_text())


def test_writes_results_report_and_plots(bench_run):
    out, _ = bench_run
    for name in ("report.md", "speedup.png", "batch_sweep.png", "accepted_length.png"):
        assert (out / name).stat().st_size > 0, name
    for name in ("speedup.png", "batch_sweep.png", "accepted_length.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_every_engine_makes_the_same_tokens(bench_run):
    _, results = bench_run
    engines = {"plain", "draft_chain", "draft_tree", "ngram", "adaptive", "hf_plain", "hf_assisted", "hf_prompt_lookup"}
    assert set(results["workloads"]) == {"completion", "grounded_edit", "docstring", "all"}
    for workload, rows in results["workloads"].items():
        assert set(rows) == engines
        prompts = 3 if workload == "all" else 1
        for name, row in rows.items():
            assert row["tokens"] == prompts * MAX_TOKENS, (workload, name)
            # Greedy speculation is exact; transformers decodes the same checkpoint in the same dtype.
            assert row["same_as_plain"] == row["same_as_own_plain"] == prompts, (workload, name)


def test_figures_are_consistent(bench_run):
    _, results = bench_run
    rows = results["workloads"]["all"]
    for name, row in rows.items():
        plain = rows["hf_plain" if name.startswith("hf_") else "plain"]
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / plain["tokens_per_s"])
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
        assert 0 < row["latency_p50_s"] <= row["latency_p99_s"]
    chain = rows["draft_chain"]
    assert 1 <= chain["mean_accepted_len"] <= 4  # K = 3
    assert sum(chain["accepted_len_counts"]) > 0 and len(chain["accepted_len_counts"]) <= 4
    assert chain["draft_share"] + chain["verify_share"] + chain["other_share"] == pytest.approx(1)
    peers = results["peers"]["all"]["draft_chain_vs_hf_assisted"]
    assert peers["tokens_per_s_ratio"] == pytest.approx(chain["tokens_per_s"] / rows["hf_assisted"]["tokens_per_s"])
    assert results["roofline"]["plain_tokens_per_s"] == rows["plain"]["tokens_per_s"]
    assert [r["batch_size"] for r in results["sweep"] if r["mode"] == "summary"] == [1, 2]
    assert results["settings"]["num_speculative_tokens"] == 3 and results["settings"]["prompts"] == 1


def test_report_shows_the_measured_numbers(bench_run):
    out, results = bench_run
    report = (out / "report.md").read_text()
    rows = results["workloads"]["all"]
    assert f"| all | specdecode plain | {rows['plain']['tokens_per_s']:.1f} | 1.00x |" in report
    assert f"{rows['draft_chain']['tokens_per_s']:.1f} | {rows['draft_chain']['speedup']:.2f}x" in report
    ratio = results["peers"]["all"]["draft_chain_vs_hf_assisted"]["tokens_per_s_ratio"]
    assert f"| all | {results['peers']['all']['plain_vs_hf_plain']['tokens_per_s_ratio']:.2f}x | {ratio:.2f}x" in report
    assert f"{100 * results['roofline']['share']:.0f}% of the ceiling" in report
    assert f"{results['machine']['torch_threads']} thread(s)" in report and "test run" in report
    for png in ("speedup.png", "batch_sweep.png", "accepted_length.png"):
        assert f"]({png})" in report


def test_compare_peers_goals():
    rows = {"plain": {"tokens_per_s": 100.0, "speedup": 1.0}, "draft_chain": {"tokens_per_s": 200.0, "speedup": 2.0},
            "ngram": {"tokens_per_s": 300.0, "speedup": 3.0}, "hf_plain": {"tokens_per_s": 50.0, "speedup": 1.0},
            "hf_assisted": {"tokens_per_s": 125.0, "speedup": 2.5}}
    out = compare_peers(rows)
    draft = out["draft_chain_vs_hf_assisted"]
    assert draft["tokens_per_s_ratio"] == 1.6 and draft["goal_tokens_per_s"]
    assert not draft["goal_speedup"]  # 2.0 < 2.5
    assert draft["best_ours_ratio"] == 300.0 / 125.0
    assert out["plain_vs_hf_plain"]["tokens_per_s_ratio"] == 2.0
    assert "ngram_vs_hf_prompt_lookup" not in out


def test_config_rejects_bad_input(tiny_models, capsys):
    with pytest.raises(ConfigError, match="unknown workload"):
        BenchConfig(target=tiny_models["target"], draft=None, workloads=("poetry",), sweep_batch_sizes=())
    with pytest.raises(ConfigError, match="needs a draft model"):
        BenchConfig(target=tiny_models["target"], draft=None)
    assert main(["bench", "--model", str(tiny_models["target"] / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
