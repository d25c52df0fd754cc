"""`specdecode bench serve`: the load generator against a real `specdecode serve` subprocess on a tiny model; the
figures it reports must agree with each other (never with the clock)."""
import asyncio

import pytest

from specdecode.bench.serve import LoadConfig, Outcome, Request, run_load, summarise
from specdecode.bench.serve_run import _served_model
from specdecode.bench.servers import ManagedServer, ServerSpec
from specdecode.cli import build_parser

PROMPTS = ["def add(a, b):", "class Point:", "for i in range(10):", "import os"]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    spec = ServerSpec("fixed", model=str(tiny_models["target"]), k=2, max_num_seqs=2, max_model_len=256)
    with ManagedServer(spec, tmp_path_factory.mktemp("serve"), startup_timeout=180) as s:
        s.wait_ready()
        yield s


@pytest.mark.parametrize("load", [LoadConfig(rate=float("inf")), LoadConfig(rate=50.0, seed=1),
                                  LoadConfig(concurrency=2)], ids=lambda load: load.label)
@pytest.mark.slow
def test_load_against_our_server(server, load):
    requests = [Request([{"role": "user", "content": p}], max_tokens=5, source=str(i)) for i, p in enumerate(PROMPTS)]
    model = _served_model(server.base_url, None)
    outcomes, seconds = asyncio.run(run_load(server.base_url, model, requests, load))
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    for o in outcomes:
        assert 1 <= o.output_tokens <= 5 and 0 < o.ttft <= o.seconds <= seconds
        assert len(o.chunk_gaps) <= o.output_tokens - 1
    row = summarise(outcomes, seconds, slo_ttft_s=1e9, slo_tpot_s=1e9)
    assert row["completed"] == 4 and row["failed"] == 0
    assert row["output_tokens"] == sum(o.output_tokens for o in outcomes)
    assert row["goodput"] == row["request_throughput"] == pytest.approx(4 / seconds)
    assert row["output_token_throughput"] == pytest.approx(row["output_tokens"] / seconds)
    for name in ("ttft", "tpot", "itl"):
        assert row[f"p50_{name}_ms"] <= row[f"p90_{name}_ms"] <= row[f"p99_{name}_ms"]
    assert summarise(outcomes, seconds, slo_ttft_s=0.0, slo_tpot_s=1e9)["goodput"] == 0
    assert server.cpu_seconds() > 0


def test_summary_counts_failures_and_slo():
    outcomes = [Outcome(True, ttft=0.1, seconds=1.1, output_tokens=11, chunk_gaps=[0.1] * 10),
                Outcome(True, ttft=3.0, seconds=4.0, output_tokens=3, chunk_gaps=[0.5, 0.5]),
                Outcome(False, error="HTTP 503")]
    row = summarise(outcomes, seconds=10.0, slo_ttft_s=2.0, slo_tpot_s=0.2)
    assert row["completed"] == 2 and row["failed"] == 1 and row["errors"] == ["HTTP 503"]
    assert outcomes[0].tpot == pytest.approx(0.1) and outcomes[1].tpot == pytest.approx(0.5)
    assert row["good_requests"] == 1 and row["goodput"] == pytest.approx(0.1)
    assert row["output_token_throughput"] == pytest.approx(1.4)
    with pytest.raises(ValueError, match="exactly one"):
        LoadConfig(rate=1.0, concurrency=2)


def test_cli_parses_serve_subcommand():
    args = build_parser().parse_args(["bench", "serve", "--rates", "0.5,inf", "--modes", "off,adaptive"])
    assert args.func.__name__ == "cmd_bench_serve" and args.rates == (0.5, float("inf"))
    assert build_parser().parse_args(["bench", "--quick"]).func.__name__ == "cmd_bench"
    assert ServerSpec("off").argv(9)[-1] == "--no-speculation" and "--no-adaptive" in ServerSpec("fixed").argv(9)
