"""The dashboard's routes and the metrics it draws, on the tiny models (the page in a real browser, and a real
Prometheus scraping the server, are tests/server/test_observability.py): the page and its script come from the
package and load nothing from elsewhere; /dashboard/data carries the very numbers /metrics shows; the counters added
for it agree with the engine's own counts; the KV gauges follow the blocks the running sequences reference; and every
metric is documented in docs/metrics.md."""
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdecode.engine.metrics import EngineMetrics

from .conftest import WAIT, SpecCounts, StepGate

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def exposition(url: str) -> dict[str, float]:
    """/metrics' specdecode series as 'name{label="value"}' -> value, without histogram buckets and creation times
    (not llama-server's llamacpp:* copies, which the dashboard does not read)."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")) or not s.name.startswith("specdecode:"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            values[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return values


def complete(server, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_page_and_its_script_come_from_the_package(server):
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="dashboard/dashboard.js">' in page.text and 'id="status"' in page.text
    script = httpx.get(server.url + "/dashboard/dashboard.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "dashboard/data" in script.text and "getContext(\"2d\")" in script.text
    for body in (page.text, script.text):
        assert "://" not in body, "the dashboard must not load anything from another site"
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy


def test_data_are_the_numbers_of_metrics(server):
    complete(server, "def add(a, b):", 12)
    assert server.engine.wait_idle(WAIT)
    data = httpx.get(server.url + "/dashboard/data").json()
    assert data["model"] == server.model and data["method"] == "draft_model"
    assert data["max_num_seqs"] == server.llm.max_num_seqs and data["poll_seconds"] > 0
    assert data["samples"] == exposition(server.url)
    assert data["samples"]["specdecode:generation_tokens_total"] >= 12


def test_added_counters_agree_with_the_engine(server):
    before, counts = exposition(server.url), SpecCounts(server)
    outs = [complete(server, prompt, n) for prompt, n in (("class Point:", 20), ("for i in range(10):", 13))]
    assert server.engine.wait_idle(WAIT)
    after, engine = exposition(server.url), counts.assert_speculated()

    def moved(name):
        return after.get(f"specdecode:{name}", 0) - before.get(f"specdecode:{name}", 0)

    positions = range(server.llm.tree_size)
    drafted = [moved(f'spec_decode_num_drafts_per_pos_total{{position="{p}"}}') for p in positions]
    accepted = [moved(f'spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}') for p in positions]
    assert drafted[0] == engine["drafts"]  # every draft has a first position
    assert sum(drafted) == engine["draft_tokens"]  # a chain's depth is its length
    assert all(d >= a for d, a in zip(drafted, accepted)) and drafted == sorted(drafted, reverse=True)
    assert moved('spec_decode_num_draft_tokens_by_method_total{method="draft_model"}') == engine["draft_tokens"]
    assert moved('spec_decode_num_accepted_tokens_by_method_total{method="draft_model"}') == engine["accepted_tokens"]
    # Each request takes one sequence-step per decode step it is in.
    assert moved("decode_batch_size_sum") == engine["steps"]
    assert moved("decode_batch_size_count") == moved("spec_decode_verify_time_seconds_count") > 0
    assert moved("spec_decode_actual_seconds_total") > 0 and moved("spec_decode_plain_equivalent_seconds_total") > 0
    assert moved("generation_tokens_total") == sum(o["usage"]["completion_tokens"] for o in outs) == 33
    assert after["specdecode:kv_cache_usage_perc"] == 0  # nothing runs any more


def test_kv_use_is_the_share_of_blocks_the_running_sequences_reference(server, monkeypatch):
    cache = server.llm.runner.cache
    assert cache.paged, "the server fixture is meant to use the engine's default, paged, cache"
    gate = StepGate(server.engine, monkeypatch)
    answers = []
    prompt = "import os\nimport sys\nimport json\nimport time\n\ndef main(argv):\n    return len(argv)\n"
    request = threading.Thread(target=lambda: answers.append(complete(server, prompt, 6)))
    request.start()
    try:
        assert gate.entered.wait(WAIT)  # prefilled: the prompt and the first token are in the cache
        held = exposition(server.url)
    finally:
        gate.opened.set()
        request.join(WAIT)
    used, free = held["specdecode:kv_cache_blocks_used"], held["specdecode:kv_cache_blocks_free"]
    assert used + free == cache.num_blocks and 0 <= held["specdecode:kv_cache_blocks_cached"] <= free
    assert held["specdecode:kv_cache_usage_perc"] == used / (used + free) > 0
    prompt_tokens = answers[0]["usage"]["prompt_tokens"]
    assert prompt_tokens > cache.block_size  # (so that the prompt spans more than one block)
    assert used >= -(-prompt_tokens // cache.block_size)
    assert server.engine.wait_idle(WAIT)
    idle = exposition(server.url)
    assert idle["specdecode:kv_cache_usage_perc"] == 0 and idle["specdecode:kv_cache_blocks_used"] == 0
    assert idle["specdecode:kv_cache_blocks_free"] == cache.num_blocks


def test_every_metric_is_documented():
    """docs/metrics.md names each metric as /metrics writes it (counters with _total), and no other."""
    documented = set(re.findall(r"`(specdecode:[a-z0-9_]+)`", DOCS.read_text()))
    metrics = EngineMetrics()  # watching a combining proposer (auto) adds its by-source counters
    scheduler = SimpleNamespace(num_slots=1, running=[], runner=SimpleNamespace(paged=False))
    metrics.watch(scheduler, 8, "auto", SimpleNamespace(counts={"ngram": [3, 1]}))
    exposed = {f.name + ("_total" if f.type == "counter" else "") for f in metrics.registry.collect()}
    assert exposed - documented == set(), "document these in docs/metrics.md"
    assert documented - exposed == set(), "docs/metrics.md names metrics that do not exist"


@pytest.mark.parametrize("positions, width", [(9, 420), (17, 420), (6, 300), (33, 700)])
def test_position_labels_never_overlap(positions, width):
    """The "acceptance per draft position" chart's labels, drawn by the page's own script (under node, with a
    canvas that records them): no two labels on one line overlap, whatever K (the pair drafts up to 8: its
    "pos i: a%" labels ran into each other), and position 0 is always labelled."""
    import json
    import shutil
    import subprocess
    from pathlib import Path

    import specdecode.server

    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("node is not installed")
    script = Path(specdecode.server.__file__).parent / "static" / "dashboard.js"
    run = subprocess.run([node, str(Path(__file__).with_name("dashboard_labels.js")), str(script), str(positions),
                          str(width)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    texts = [t for t in json.loads(run.stdout) if t["align"] == "center"]
    assert any(t["text"] == "0" for t in texts)
    rows: dict[float, list] = {}
    for t in texts:
        half = 6.2 * len(t["text"]) / 2
        rows.setdefault(t["y"], []).append((t["x"] - half, t["x"] + half))
    for spans in rows.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
