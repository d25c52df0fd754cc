"""`specdecode bench serve --mix assistant`: the mix's closed loops against a real `specdecode serve` subprocess on a
tiny model; the per-class figures agree with the outcomes they summarise, and the report and plot are written."""
import asyncio
import json

import pytest

from specdecode.bench.mix import QUESTION, MixOutcome, long_requests, run_mix, short_requests, summarise_mix, write_mix_report
from specdecode.bench.serve import Outcome
from specdecode.bench.serve_run import _served_model
from specdecode.bench.servers import ManagedServer, ServerSpec
from specdecode.cli import build_parser
from specdecode.model.tokenizer import Tokenizer


def test_the_mix_requests_are_the_shipped_questions_and_long_held_out_files(tiny_models):
    short = short_requests(32)
    assert len(short) >= 30 and all(r.max_tokens == 32 and r.source.startswith("code_problems:") for r in short)
    tokenizer = Tokenizer(tiny_models["target"])
    long = long_requests(tokenizer, 200, 16)
    assert long and len({r.source for r in long}) == len(long)  # each a different file
    frame = len(tokenizer.encode("```python\n```" + QUESTION, add_special_tokens=False))
    for r in long:
        text = r.messages[0]["content"]
        assert r.source.startswith("stdlib:") and r.max_tokens == 16 and text.endswith(QUESTION)
        assert 100 <= len(tokenizer.encode(text, add_special_tokens=False)) - frame <= 205  # (whole lines of 200)


def test_summary_per_class():
    outcomes = [MixOutcome("short", 0.0, Outcome(True, 0.5, 1.0, 5, [0.1, 0.1, 0.2])),
                MixOutcome("short", 1.0, Outcome(True, 1.5, 2.0, 3, [0.3])),
                MixOutcome("short", 2.0, Outcome(False, error="HTTP 500")),
                MixOutcome("long", 0.0, Outcome(True, 8.0, 9.0, 4, [0.2, 0.2])),
                MixOutcome("long", 4.0, Outcome(False, 5.0, output_tokens=1, error="cut off"), cut_off=True),
                MixOutcome("short", 3.0, Outcome(False, 7.0, error="cut off"), cut_off=True)]
    summary = summarise_mix(outcomes, 10.0)
    # cut off: neither done nor failed; a first token seen counts in TTFT, a wait without one is listed apart
    assert summary["long"]["cut_off"] == 1 and summary["long"]["ttfts_ms"] == [8000.0, 5000.0]
    assert summary["short"]["cut_off"] == 1 and summary["short"]["waiting_at_end_s"] == [7.0]
    assert summary["short"]["done"] == 2 and summary["short"]["failed"] == 1
    assert summary["short"]["errors"] == ["HTTP 500"] and summary["long"]["done"] == 1
    assert summary["output_tokens_per_s"] == pytest.approx(1.2)
    assert summary["short"]["ttfts_ms"] == [500.0, 1500.0]
    assert summary["short"]["p50_ttft_ms"] <= summary["short"]["p99_ttft_ms"] == pytest.approx(1500, rel=0.02)


@pytest.mark.slow
def test_the_mix_against_our_server(tiny_models, tmp_path):
    spec = ServerSpec("adaptive", model=str(tiny_models["target"]), k=2, max_num_seqs=3, max_model_len=512)
    with ManagedServer(spec, tmp_path, startup_timeout=180) as server:
        server.wait_ready()
        model = _served_model(server.base_url, None)
        short = short_requests(8)
        long = long_requests(Tokenizer(tiny_models["target"]), 200, 8)
        outcomes, seconds = asyncio.run(run_mix(server.base_url, model, short, long, 2, 1, 6.0))
    finished = [m for m in outcomes if not m.cut_off]
    assert all(m.outcome.ok for m in finished), [m.outcome.error for m in finished]
    assert len(outcomes) - len(finished) <= 3  # at most each loop's last request, cut off at max_seconds
    kinds = [m.kind for m in finished]
    assert kinds.count("short") >= 2 and kinds.count("long") >= 1
    assert all(0 <= m.sent <= 6.0 and 0 < m.outcome.ttft <= m.outcome.seconds for m in finished)
    summary = summarise_mix(outcomes, seconds)
    assert summary["short"]["done"] == kinds.count("short") and summary["long"]["done"] == kinds.count("long")
    results = {"settings": {"note": "test", "streams": 2, "long_streams": 1, "long_tokens": 200, "max_seconds": 6.0},
               "cpu": "test", "runs": {"ours": summary}}
    paths = write_mix_report(results, tmp_path / "out")
    assert json.loads(paths["results"].read_text())["runs"]["ours"]["short"]["done"] == summary["short"]["done"]
    assert "| ours |" in paths["report"].read_text() and paths["plot"].stat().st_size > 10_000


def test_cli_parses_the_mix():
    args = build_parser().parse_args(["bench", "serve", "--mix", "assistant", "--target", "ours=http://127.0.0.1:1",
                                      "--target", "llama=http://127.0.0.1:2", "--streams", "6"])
    assert args.mix == "assistant" and args.target == ["ours=http://127.0.0.1:1", "llama=http://127.0.0.1:2"]
    assert args.long_tokens == 4096 and args.long_max_tokens == 64 and args.streams == 6
