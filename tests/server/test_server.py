"""The OpenAI-compatible server, started for real on loopback and driven by the official openai client. Tests of
speculative serving check that drafts were proposed and accepted; tests of disconnects hold the engine with a
gate instead of hoping that generation outlasts the client."""
import asyncio
import json
import socket

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams

from .conftest import WAIT, SpecCounts, StepGate, running_server

WORDS = ["def", "class", "import", "return", "for", "print", "self", "Point", "range", "sys"]
PROMPTS = [f"{WORDS[i % 10]} {WORDS[(3 * i + 1) % 10]}(" for i in range(16)]
JSON = {"Content-Type": "application/json"}


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


def finished_by_length(server) -> float:
    return metrics(server).get('specdecode:request_success_total{"finished_reason": "length"}', 0)


def test_models_and_health(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client(server).models.list()
    assert [m.id for m in models.data] == [server.model]


def test_completion_matches_offline_generate(server, reference):
    counts = SpecCounts(server)
    out = client(server).completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=20, temperature=0)
    expected = offline(reference, [PROMPTS[0]], [20])[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.completion_tokens == len(expected.token_ids)
    counts.assert_speculated()


def test_streaming_equals_non_streaming(server):
    counts = SpecCounts(server)
    c = client(server)
    whole = c.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=24, temperature=0)
    chunks = list(c.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    counts.assert_speculated()


def test_chat_uses_the_chat_template_and_streams(server, reference):
    counts = SpecCounts(server)
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
    counts.assert_speculated()


def test_sixteen_concurrent_clients_each_get_their_own_text(server, reference):
    counts = SpecCounts(server)
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
    counts.assert_speculated()


def test_metric_deltas_equal_the_engine_counts(server):
    """Every speculation counter moves by exactly what the engine itself counted; emitted = accepted + one per
    step that drafted; the completions account for every token (1 from the prefill + accepted + 1 per step)."""
    before, counts = metrics(server), SpecCounts(server)
    lengths = [17, 30, 9]
    outs = [client(server).completions.create(model=server.model, prompt=PROMPTS[2 + i], max_tokens=n,
                                              temperature=0, extra_body={"ignore_eos": True})
            for i, n in enumerate(lengths)]
    after, engine = metrics(server), counts.assert_speculated()

    def moved(name):
        return after[f"specdecode:{name}"] - before.get(f"specdecode:{name}", 0)

    assert moved("spec_decode_num_drafts_total") == engine["drafts"]
    assert moved("spec_decode_num_draft_tokens_total") == engine["draft_tokens"]
    assert moved("spec_decode_num_accepted_tokens_total") == engine["accepted_tokens"]
    assert moved("spec_decode_num_emitted_tokens_total") == engine["accepted_tokens"] + engine["drafts"]
    for pos, n in enumerate(engine["accepted_per_pos"]):
        assert moved(f'spec_decode_num_accepted_tokens_per_pos_total{{"position": "{pos}"}}') == n, pos
    assert sum(engine["accepted_per_pos"]) == engine["accepted_tokens"]
    completion_tokens = sum(o.usage.completion_tokens for o in outs)
    assert completion_tokens == sum(lengths) == moved("generation_tokens_total")
    assert completion_tokens == len(outs) + engine["steps"] + engine["accepted_tokens"]
    assert engine["accepted_tokens"] > engine["drafts"], "several drafts accepted in one step, some of the time"
    assert moved("time_to_first_token_seconds_count") == moved("e2e_request_latency_seconds_count") == len(outs)
    assert moved("spec_decode_verify_time_seconds_count") == engine["steps"]
    assert after["specdecode:spec_decode_realised_speedup"] > 0
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
    ("completions", {"prompt": "x", "top_k": 2 ** 63}),  # once failed every request in flight, and leaked a slot
    ("completions", {"prompt": "x", "top_k": 10 ** 6}),  # more than the vocabulary
    ("completions", {"prompt": "x", "seed": 2 ** 70}),
    ("completions", {"prompt": "x", "stop": [""]}),
    ("completions", {"prompt": "x", "stop": 7}),
    ("completions", {"prompt": "x", "stop": [str(i) for i in range(17)]}),  # more than --max-stop-strings
    ("completions", {"prompt": "x", "stop": "s" * 257}),  # longer than --max-stop-chars
    ("completions", {"prompt": "x", "n": 17}),
    ("completions", {"prompt": ""}),
    ("completions", {"prompt": []}),
    ("completions", {"prompt": [10 ** 9]}),
    ("completions", {"prompt": [1] * 600}),  # longer than the context: refused before its ids are scanned
    ("completions", {"prompt": "def f(): pass\n" * 600}),
    ("completions", {"prompt": ["a", "b"]}),
    ("completions", {"max_tokens": 4}),
    ("chat/completions", {"messages": []}),
    ("chat/completions", {"messages": "hi"}),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -2}),  # (-1: no limit)
    ("completions", {"prompt": "x", "max_tokens": -2}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 1025}),  # more than --max-messages
]


@pytest.mark.parametrize("path,body", BAD_BODIES)
def test_bad_input_gets_a_4xx_in_openai_format(server, path, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/{path}", content=content, headers=JSON)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]


def test_the_engine_survives_bad_input(server, reference):
    for path, body in BAD_BODIES:
        httpx.post(f"{server.url}/v1/{path}", content=body if isinstance(body, bytes) else json.dumps(body),
                   headers=JSON)
    assert server.engine.health() is None
    test_completion_matches_offline_generate(server, reference)
    assert server.engine.wait_idle(WAIT) and len(server.engine.scheduler.free) == server.llm.max_num_seqs


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


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server, monkeypatch):
    assert server.engine.wait_idle(WAIT)
    before = finished_by_length(server)
    gate = StepGate(server.engine, monkeypatch)
    body = {"prompt": PROMPTS[5], "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=WAIT) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert gate.entered.wait(WAIT)  # the request is being generated: now hang up
    assert gate.aborted.wait(WAIT), "the server did not notice the client leave"
    gate.opened.set()
    assert server.engine.wait_idle(WAIT)
    assert finished_by_length(server) == before
    assert len(server.engine.scheduler.free) == server.llm.max_num_seqs


def test_a_client_that_gives_up_on_a_non_streaming_request_frees_its_slot(server, monkeypatch):
    assert server.engine.wait_idle(WAIT)
    before = finished_by_length(server)
    gate = StepGate(server.engine, monkeypatch)
    body = json.dumps({"prompt": PROMPTS[6], "max_tokens": 480, "temperature": 0, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert gate.entered.wait(WAIT)  # the request is being generated: now hang up
    assert gate.aborted.wait(WAIT), "the server did not notice the client leave"
    gate.opened.set()
    assert server.engine.wait_idle(WAIT)
    assert finished_by_length(server) == before
    assert len(server.engine.scheduler.free) == server.llm.max_num_seqs


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
    for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 7235)
        assert http_ok(small_server, {"Authorization": f"{scheme} sesame"})
    for header in ("Bearer", "Basic sesame", "Bearer sesame2", "sesame"):
        assert httpx.get(small_server.url + "/v1/models", headers={"Authorization": header}).status_code == 401
    assert httpx.get(small_server.url + "/health").status_code == 200


def test_requests_beyond_the_queue_limit_are_refused(small_server, monkeypatch):
    gate = StepGate(small_server.engine, monkeypatch)
    headers = {"Authorization": "Bearer sesame"}
    body = {"prompt": "import os", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=WAIT, headers=headers) as http:
        with http.stream("POST", small_server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            # Inside its first decode step, the long request holds the only slot. (Waiting for its first event
            # instead could wait for ever: a token that ends in part of a UTF-8 character sends no text yet.)
            assert gate.entered.wait(WAIT)
            refused = http.post(small_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
    assert gate.aborted.wait(WAIT)
    gate.opened.set()
    assert small_server.engine.wait_idle(WAIT)
    monkeypatch.undo()
    assert http_ok(small_server, headers)


def http_ok(server, headers) -> bool:
    return httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                      headers=headers).status_code == 200
