"""Property-based fuzzing of the HTTP API (schemathesis, from the server's own /openapi.json): a bounded run against
the tiny model with speculation on; no 5xx, every 4xx in OpenAI's error format, every answer as the schema says;
afterwards the server still answers greedy requests exactly as offline generation does, with no request left
running or waiting. (specdecode bench fuzz runs the same checks at length.)"""
import httpx
import pytest

from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams

from .conftest import running_server, speculative_config
from .test_server import metrics

pytest.importorskip("schemathesis")
from specdecode.bench.fuzz import fuzz, still_serves  # noqa: E402 (needs schemathesis)

CONTEXT = 64
"""A small context keeps every generated request short."""


@pytest.fixture(scope="module")
def fuzzed(tiny_models):
    llm = LLM(tiny_models["target"], dtype="float32", speculative_config=speculative_config(tiny_models),
              max_num_seqs=4, max_model_len=CONTEXT)
    with running_server(llm) as server:
        yield server


def test_schema_describes_the_request_bodies(fuzzed):
    schema = httpx.get(fuzzed.url + "/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "ErrorResponse" in str(schema["paths"][path]["post"]["responses"]["400"])
    assert components["CompletionRequest"]["required"] == ["prompt"]
    assert components["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] == 1024
    assert components["CompletionRequest"]["properties"]["model"]["anyOf"][0]["enum"] == ["tiny"]
    assert "ChatMessage" in components


@pytest.mark.slow
def test_fuzzed_requests_get_no_5xx_and_openai_errors(fuzzed):
    report = fuzz(fuzzed.url, examples=40, seed=0, workers=4)
    assert report.failed == 0, "\n".join(report.failures)
    assert report.requests >= 150 and report.server_errors == 0
    assert report.statuses[200] >= 30 and report.statuses[400] >= 50, report.summary()  # both kinds were reached


def test_still_serves_exactly_after_fuzzing(fuzzed, tiny_models):
    fuzz(fuzzed.url, examples=10, seed=1, workers=4)
    body = still_serves(fuzzed.url, prompt="def add(a, b):", max_tokens=12)
    offline = LLM(tiny_models["target"], dtype="float32").generate(
        "def add(a, b):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    assert body["choices"][0]["text"] == offline
    assert fuzzed.engine.wait_idle(60)
    gauges = metrics(fuzzed)
    assert gauges["specdecode:num_requests_running"] == 0 and gauges["specdecode:num_requests_waiting"] == 0


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_json_is_a_400(fuzzed, depth):
    body = b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
    response = httpx.post(fuzzed.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                          timeout=60)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
