"""The speed benchmark (specdecode/bench/speed.py): runs end to end on a tiny checkpoint and reports every goal."""
import json

import pytest
import torch

from specdecode.bench.speed import GOALS, SpeedConfig, configurations, pass_costs, run_speed
from specdecode.bench.speed_report import write_speed_report
from specdecode.errors import ConfigError
from specdecode.model.loading import load_model


@pytest.mark.slow
def test_speed_run_and_report(tiny_models, tmp_path):
    config = SpeedConfig(model=tiny_models["target"], tokens=6, rounds=1, dtypes=("float32",), max_verify=8,
                         batch=2, peers=True, clock="cpu")
    results = run_speed(config, log=lambda s: None)
    names = [f"float32 {b}" for b in ("onednn", "plain") if ("float32", b) in configurations(config)]
    assert list(results["decode"]) == names + ["transformers float32"]
    for name in names:
        row = results["decode"][name]
        assert row["tokens_per_s"] > 0 and 0 < row["roofline_share"] and row["same_as_first"]
        assert results["verify"][name]["relative"][1] == 1.0 and len(results["verify"][name]["relative"]) == 8
    goals = {g["goal"] for g in results["goals"]}
    assert {"plain_fp32_vs_hf_fp32", "roofline_share", "verify_5", "verify_8", "batch_2"} <= goals
    for name in names:  # float weights: the memory limit's share only
        shares = results["verify"][name]["memory_share"]
        assert 0 < shares[1] and shares[8] < shares[1] and results["verify"][name]["arithmetic_share"] is None
    assert set(results["speculation"]["rows"]) <= set(names)
    paths = write_speed_report(results, tmp_path)
    text = paths["report"].read_text()
    assert "## Goals" in text and "pass over 8 tokens" in text and paths["plot"].stat().st_size > 1000
    assert json.loads(paths["json"].read_text())["verify"][names[0]]["relative"]["8"] > 0


def test_pass_costs_grow_with_tokens(tiny_models):
    model = load_model(tiny_models["target"], dtype="float32")
    costs = pass_costs({"m": model}, [1, 16], context=20, repeats=2, calls=2)["m"]
    assert 0 < costs[1] and 0 < costs[16]


def test_bad_speed_config_is_refused(tiny_models):
    with pytest.raises(ConfigError, match="dtype"):
        SpeedConfig(model=tiny_models["target"], dtypes=("float8",))
    with pytest.raises(ConfigError, match="clock"):
        SpeedConfig(model=tiny_models["target"], clock="sundial")
    assert GOALS["verify_8"] == 1.4 and GOALS["verify_5"] == 1.25 and GOALS["verify_16"] == 2.2


def test_int8_is_offered_only_with_reduced_precision(tiny_models):
    config = SpeedConfig(model=tiny_models["target"], dtypes=("float32", "bfloat16"), backends=("int8",))
    assert all(dtype != "float32" for dtype, _ in configurations(config))
    assert torch.get_num_threads() == 1  # the cpu clock needs one thread (tests/conftest.py sets it)


@pytest.mark.slow
def test_bench_speed_cli(tiny_models, tmp_path, capsys):
    from specdecode.cli import main

    code = main(["bench", "--speed", "--quick", "--no-peers", "--max-tokens", "4", "--model",
                 str(tiny_models["target"]), "--out", str(tmp_path)])
    assert code == 0
    assert (tmp_path / "speed.md").is_file() and "## Goals" in capsys.readouterr().out
