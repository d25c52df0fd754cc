"""The OpenAI-compatible server, started for real on loopback and driven by the official openai client."""
import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams

from .conftest import running_server

WORDS = ["def", "class", "import", "return", "for", "print", "self", "Point", "range", "sys"]
PROMPTS = [f"{WORDS[i % 10]} {WORDS[(3 * i + 1) % 10]}(" for i in range(16)]


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                         **kwargs)


def offline(reference: LLM, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    return [o.outputs[0] for o in reference.generate(prompts, params)]


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {(s.name + json.dumps(s.labels, sort_keys=True) if s.labels else s.name): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_until_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while server.engine.scheduler.has_work or server.engine._in_system:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)


def test_models_and_health(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = client(server).models.list()
    assert [m.id for m in models.data] == [server.model]


def test_completion_matches_offline_generate(server, reference):
    out = client(server).completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=20, temperature=0)
    expected = offline(reference, [PROMPTS[0]], [20])[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.completion_tokens == len(expected.token_ids)


def test_streaming_equals_non_streaming(server):
    c = client(server)
    whole = c.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=24, temperature=0)
    chunks = list(c.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_uses_the_chat_template_and_streams(server, reference):
    c = client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    whole = c.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0)
    prompt = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert whole.choices[0].message.content == offline(reference, [prompt], [16])[0].text
    assert whole.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0,
                                       stream=True)
    deltas = [ch.choices[0].delta for ch in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content


def test_sixteen_concurrent_clients_each_get_their_own_text(server, reference):
    max_tokens = [8 + 3 * i for i in range(16)]  # different lengths: sequences leave and join mid-batch
    expected = offline(reference, PROMPTS, max_tokens)

    async def one(c, i):
        if i % 2:
            out = await c.completions.create(model=server.model, prompt=PROMPTS[i], max_tokens=max_tokens[i],
                                             temperature=0)
            return out.choices[0].text
        stream = await c.completions.create(model=server.model, prompt=PROMPTS[i], max_tokens=max_tokens[i],
                                            temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(16)))

    texts = asyncio.run(main())
    assert texts == [e.text for e in expected]


def test_metrics_parse_and_counters_move(server):
    before = metrics(server)
    controller = server.llm.controller
    controller.fixed_k = 3  # the tiny draft is as big as its target: left alone, the engine rarely drafts
    try:
        client(server).completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=32, temperature=0)
    finally:
        controller.fixed_k = None
    after = metrics(server)
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_emitted_tokens",
                 "generation_tokens", "prompt_tokens"):
        assert after[f"specdecode:{name}_total"] > before.get(f"specdecode:{name}_total", 0), name
    assert after["specdecode:spec_decode_num_emitted_tokens_total"] >= after[
        "specdecode:spec_decode_num_accepted_tokens_total"]
    assert after["specdecode:time_to_first_token_seconds_count"] > before["specdecode:time_to_first_token_seconds_count"]
    assert after["specdecode:e2e_request_latency_seconds_count"] > before["specdecode:e2e_request_latency_seconds_count"]
    assert after["specdecode:spec_decode_verify_time_seconds_count"] > 0
    assert after["specdecode:spec_decode_realised_speedup"] > 0
    assert 'specdecode:spec_decode_num_accepted_tokens_per_pos_total{"position": "0"}' in after
    assert after["specdecode:num_requests_running"] == 0


BAD_BODIES = [
    ("completions", b"{not json"),
    ("completions", b"[1, 2]"),
    ("completions", b""),
    ("completions", {"prompt": 5}),
    ("completions", {"prompt": "x", "max_tokens": "ten"}),
    ("completions", {"prompt": "x", "max_tokens": 2.5}),
    ("completions", {"prompt": "x", "max_tokens": 0}),
    ("completions", {"prompt": "x", "max_tokens": -3}),
    ("completions", {"prompt": "x", "max_tokens": 10 ** 6}),
    ("completions", {"prompt": "x", "temperature": -0.5}),
    ("completions", {"prompt": "x", "temperature": "hot"}),
    ("completions", {"prompt": "x", "top_p": 0}),
    ("completions", {"prompt": "x", "top_p": 1.5}),
    ("completions", {"prompt": "x", "top_k": -5}),
    ("completions", {"prompt": "x", "seed": 2 ** 70}),
    ("completions", {"prompt": "x", "stop": [""]}),
    ("completions", {"prompt": "x", "stop": 7}),
    ("completions", {"prompt": "x", "n": 2}),
    ("completions", {"prompt": ""}),
    ("completions", {"prompt": []}),
    ("completions", {"prompt": [10 ** 9]}),
    ("completions", {"prompt": "def f(): pass\n" * 600}),
    ("completions", {"prompt": ["a", "b"]}),
    ("completions", {"prompt": "x", "model": "some-other-model"}),
    ("completions", {"max_tokens": 4}),
    ("chat/completions", {"messages": []}),
    ("chat/completions", {"messages": "hi"}),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}),
]


@pytest.mark.parametrize("path,body", BAD_BODIES)
def test_bad_input_gets_a_4xx_in_openai_format(server, path, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/{path}", content=content, headers={"Content-Type": "application/json"})
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]


def test_the_engine_survives_bad_input(server, reference):
    for path, body in BAD_BODIES[:8]:
        httpx.post(f"{server.url}/v1/{path}", content=body if isinstance(body, bytes) else json.dumps(body))
    assert server.engine.alive
    test_completion_matches_offline_generate(server, reference)


def test_per_request_switches(server, reference):
    c = client(server)
    plain = c.completions.create(model=server.model, prompt=PROMPTS[3], max_tokens=20, temperature=0,
                                 extra_body={"use_speculation": False})
    assert plain.choices[0].text == offline(reference, [PROMPTS[3]], [20])[0].text
    stopped = c.completions.create(model=server.model, prompt=PROMPTS[3], max_tokens=20, temperature=0,
                                   stop=[plain.choices[0].text[3:5]])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == plain.choices[0].text[:3]
    sampled = [c.completions.create(model=server.model, prompt=PROMPTS[4], max_tokens=16, temperature=1.0, seed=7,
                                    extra_body={"use_speculation": False}).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    wait_until_idle(server)
    before = metrics(server).get('specdecode:request_success_total{"finished_reason": "length"}', 0)
    body = {"prompt": PROMPTS[5], "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data:"):
                    break  # read one event, then hang up
    wait_until_idle(server)
    assert metrics(server).get('specdecode:request_success_total{"finished_reason": "length"}', 0) == before
    assert server.engine.scheduler.free and len(server.engine.scheduler.free) == server.llm.max_num_seqs


def test_a_client_that_gives_up_on_a_non_streaming_request_frees_its_slot(server):
    wait_until_idle(server)
    before = metrics(server).get('specdecode:request_success_total{"finished_reason": "length"}', 0)
    body = {"prompt": PROMPTS[6], "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.2)
    wait_until_idle(server)
    assert metrics(server).get('specdecode:request_success_total{"finished_reason": "length"}', 0) == before


@pytest.fixture(scope="module")
def small_server(tiny_models):
    """One slot, no waiting room, an API key, no speculation."""
    llm = LLM(tiny_models["target"], dtype="float32", max_num_seqs=1)
    with running_server(llm, api_key="sesame", max_waiting=0) as s:
        yield s


def test_api_key_is_required(small_server):
    with pytest.raises(openai.AuthenticationError):
        client(small_server, api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
    assert httpx.post(small_server.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    out = client(small_server, api_key="sesame").completions.create(model="tiny", prompt="x", max_tokens=2)
    assert out.usage.completion_tokens == 2
    assert httpx.get(small_server.url + "/health").status_code == 200


def test_requests_beyond_the_queue_limit_are_refused(small_server, monkeypatch):
    runner = small_server.llm.runner
    real_step = runner.step

    def slow_step(seqs, budgets):  # keeps the first request busy for as long as the test needs
        time.sleep(0.01)
        return real_step(seqs, budgets)

    monkeypatch.setattr(runner, "step", slow_step)
    headers = {"Authorization": "Bearer sesame"}
    body = {"prompt": "import os", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=10, headers=headers) as http:
        with http.stream("POST", small_server.url + "/v1/completions", json=body) as response:
            next(response.iter_lines())  # the long request now holds the only slot
            refused = http.post(small_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code in (429, 503)
            assert refused.json()["error"]["message"]
    wait_until_idle(small_server)
    monkeypatch.undo()
    assert http_ok(small_server, headers)


def http_ok(server, headers) -> bool:
    return httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                      headers=headers).status_code == 200
