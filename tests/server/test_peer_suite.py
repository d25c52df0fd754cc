"""A fast subset of llama.cpp's own server tests (auth, routes, fields, errors) run against `specdecode serve` on
SmolLM2 through the launcher of `specdecode bench peer-tests` (which runs all of them; its record is
docs/bench/peer_tests_2026-12-07/). The suite comes from the pinned llama-cpp-python sdist, checked by sha256; where
it cannot be fetched (no network, no cache) the test is skipped, saying so."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from specdecode.bench import peer_tests

FAST = [
    "unit/test_basic.py::test_server_start_simple",
    "unit/test_basic.py::test_server_models",
    "unit/test_security.py::test_incorrect_api_key[None]",
    "unit/test_security.py::test_incorrect_api_key[invalid-key]",
    "unit/test_security.py::test_correct_api_key_anthropic_header",
    "unit/test_security.py::test_cors_origins_localhost_rejects[http://localhost.evil.com]",
    "unit/test_tokenize.py::test_tokenize_detokenize",
    "unit/test_chat_completion.py::test_context_size_exceeded_stream",
    "unit/test_chat_completion.py::test_invalid_chat_completion_req[messages7]",
    "unit/test_chat_completion.py::test_completion_with_invalid_grammar",
    "unit/test_ignore_eos.py::test_ignore_eos_false_no_logit_bias",
    "unit/test_metrics.py::test_metrics_generation_rate_excludes_first_token",
]
"""Tests that hold whatever the model writes, each a few seconds (one server start): the key in both headers and
its error type, the CORS policy, /models, /tokenize, the context overflow error, a bad conversation and a bad grammar
refused, generation_settings.logit_bias, the timings' rates."""


@pytest.mark.slow
def test_llama_cpp_server_tests_fast_subset(smollm2, tmp_path):
    work = Path(os.environ.get("SPECDECODE_PEER_TESTS_DIR", "~/.cache/specdecode/peer_tests")).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    try:
        suite = peer_tests.fetch_suite(work)
        python = peer_tests.suite_python(work)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"llama.cpp's suite ({peer_tests.SDIST}) could not be fetched or installed: {exc}")
    junit = peer_tests.run_suite(suite, python, tmp_path, FAST, str(smollm2), test_timeout=60)
    results = peer_tests.outcomes(junit)
    assert sorted(results) == sorted(FAST), (tmp_path / "pytest.log").read_text()[-3000:]
    failed = {test_id: message for test_id, (status, message) in results.items() if status != "passed"}
    assert not failed, json.dumps(failed, indent=1) + (tmp_path / "pytest.log").read_text()[-3000:]


def test_the_launcher_maps_llama_servers_flags():
    argv = ["--port", "8123", "--temp", "0.8", "--seed", "42", "--host", "127.0.0.1", "--hf-repo", "ggml-org/x",
            "--no-slots", "--alias", "tinyllama-2", "--ctx-size", "512", "--parallel", "2", "--n-predict", "64",
            "--api-key", "sk-k", "--cors-origins", "localhost", "--no-jinja"]
    args = peer_tests.serve_args(argv, "model.gguf")
    assert args[:3] == ["serve", "--model", "model.gguf"]
    pairs = dict(zip(args[3::2], args[4::2]))
    assert pairs["--port"] == "8123" and pairs["--host"] == "127.0.0.1" and pairs["--api-key"] == "sk-k"
    assert pairs["--max-num-seqs"] == "2" and pairs["--max-model-len"] == "256"  # the context is split over slots
    assert pairs["--served-model-name"] == "tinyllama-2" and pairs["--cors-origins"] == "localhost"
    assert "--hf-repo" not in args and "--seed" not in args


def test_every_outcome_is_classified(tmp_path):
    """A failing test is explained by the table, a passing one is not (stale entries are reported)."""
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite><testcase file="unit/test_a.py" name="test_ok"/>'
                   '<testcase file="unit/test_a.py" name="test_text"><failure message="assert 1 == 2"/></testcase>'
                   '<testcase file="unit/test_a.py" name="test_new"><failure message="KeyError: x"/></testcase>'
                   '</testsuite></testsuites>')
    classes = {"unit/test_a.py::test_text": {"class": "model-dependent", "reason": "words"},
               "unit/test_a.py::test_ok": {"class": "protocol", "reason": "fixed since"}}
    table = peer_tests.classify(peer_tests.outcomes(xml), classes)
    assert table["unit/test_a.py::test_ok"]["class"] == "passed"
    assert table["unit/test_a.py::test_text"]["class"] == "model-dependent"
    assert table["unit/test_a.py::test_new"]["class"] == "unclassified"
    assert peer_tests.stale(table, classes) == ["unit/test_a.py::test_ok"]
    assert peer_tests.counts(table)["unclassified"] == 1


def test_the_table_names_known_classes_and_reasons():
    table = json.loads(peer_tests.CLASSES_FILE.read_text())
    assert table, "the classification table is empty"
    for test_id, entry in table.items():
        assert test_id.startswith("unit/test_") and "::" in test_id
        assert entry["class"] in peer_tests.CLASSES[1:] and entry["reason"], test_id
