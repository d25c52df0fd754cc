"""What a client cannot do to the server: send non-JSON or oversized bodies, address it by a foreign host name,
hold connections open half-sent, stall other clients with heavy requests, run Python from a chat template, or
learn another request's internal errors."""
import asyncio
import json
import socket
import threading

import httpx
import pytest

import specdecode.engine.step as step_module
from specdecode.engine.llm import LLM
from specdecode.server.guard import host_name
from specdecode.server.limits import ServerLimits

from .conftest import WAIT, running_server

LIMITS = ServerLimits(max_body_bytes=4096, max_messages=4, max_stop_strings=2, max_stop_chars=8, max_prompt_tokens=40,
                      body_timeout=2.0, header_timeout=1.0)
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def limited(tiny_models):
    """Small limits and short timeouts, plain decoding, two slots."""
    llm = LLM(tiny_models["target"], dtype="float32", max_num_seqs=2)
    with running_server(llm, limits=LIMITS) as s:
        yield s


def post(server, path, body, headers=JSON, **kwargs):
    content = body if not isinstance(body, dict) else json.dumps(body).encode()
    return httpx.post(f"{server.url}/v1/{path}", content=content, headers=headers, timeout=WAIT, **kwargs)


def error(response, status):
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["message"] and body["type"]
    return body


@pytest.mark.parametrize("headers", [{"Content-Type": "text/plain"},
                                     {"Content-Type": "application/x-www-form-urlencoded"}, {}])
def test_a_web_page_must_send_json(limited, headers):
    """A web page may POST text/plain or a form cross-origin without a preflight; JSON needs one, which is never
    granted without --cors-origins. A client that is not a page (no Origin: curl -d) is read as llama-server reads it."""
    page = {**headers, "Origin": "http://evil.example"}
    response = post(limited, "completions", {"prompt": "x", "max_tokens": 2}, headers=page)
    assert "Content-Type: application/json" in error(response, 415)["message"]
    assert post(limited, "completions", {"prompt": "x", "max_tokens": 2}, headers=headers).status_code == 200
    assert post(limited, "completions", {"prompt": "x", "max_tokens": 2},
                headers={"Content-Type": "application/json; charset=utf-8", "Origin": "http://evil.example"}
                ).status_code == 200  # the browser's preflight stops that one (test_llama_routes' CORS tests)


def test_host_must_be_one_the_server_answers_to(limited):
    for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example"):
        response = httpx.get(limited.url + "/v1/models", headers={"Host": host})
        assert "--allowed-hosts" in error(response, 400)["message"]
        assert httpx.get(limited.url + "/metrics", headers={"Host": host}).status_code == 400
    for host in (f"127.0.0.1:{limited.port}", "localhost", f"LOCALHOST:{limited.port}", "[::1]:80"):
        assert httpx.get(limited.url + "/v1/models", headers={"Host": host}).status_code == 200


def test_host_names_parse():
    assert host_name("Example.com:8000") == "example.com"
    assert host_name("[::1]:8000") == "::1" and host_name("::1") == "::1" and host_name("") == ""


def test_allowed_hosts_extend_or_open_the_list(tiny_models):
    llm = LLM(tiny_models["target"], dtype="float32", max_num_seqs=1)
    with running_server(llm, allowed_hosts=["127.0.0.1", "api.example"]) as s:
        assert httpx.get(s.url + "/health", headers={"Host": "api.example:443"}).status_code == 200
        assert httpx.get(s.url + "/health", headers={"Host": "other.example"}).status_code == 400
    with running_server(llm, allowed_hosts=["*"]) as s:
        assert httpx.get(s.url + "/health", headers={"Host": "other.example"}).status_code == 200


def test_oversized_bodies_are_refused_unread(limited):
    big = {"prompt": "x" * 5000, "max_tokens": 2}
    assert error(post(limited, "completions", big), 413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(10):
            yield b" " * 1000
    assert post(limited, "completions", chunks()).status_code == 413


@pytest.mark.parametrize("path,body,param", [
    ("completions", {"prompt": "x", "stop": ["a", "b", "c"]}, "stop"),
    ("completions", {"prompt": "x", "stop": "123456789"}, "stop"),
    ("completions", {"prompt": list(range(41))}, "prompt"),
    ("completions", {"prompt": "import os " * 30}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 5}, "messages"),
])
def test_configured_limits_are_answered_with_400(limited, path, body, param):
    assert error(post(limited, path, {"max_tokens": 2, **body}), 400)["param"] == param


def raw_exchange(server, data: bytes) -> bytes:
    """Send data, then read until the server closes the connection (or WAIT passes)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


@pytest.mark.slow
def test_half_sent_requests_are_cut_off(limited):
    # A request head that never ends: the connection is closed (uvicorn alone would keep it forever).
    assert raw_exchange(limited, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n") == b""
    # A body that never ends: 408.
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    assert raw_exchange(limited, head).startswith(b"HTTP/1.1 408 ")
    # A request head growing past max_header_bytes.
    huge = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * (LIMITS.max_header_bytes + 1)
    assert raw_exchange(limited, huge).startswith(b"HTTP/1.1 400 ")


def test_request_preparation_runs_off_the_event_loop(limited, monkeypatch):
    """While one request's chat template renders (here: until the test lets it), other clients are served."""
    entered, release = threading.Event(), threading.Event()
    tokenizer = limited.llm.tokenizer
    real = tokenizer.apply_chat_template

    def slow_template(messages, add_generation_prompt=True):
        entered.set()
        assert release.wait(WAIT)
        return real(messages, add_generation_prompt)

    monkeypatch.setattr(tokenizer, "apply_chat_template", slow_template)

    async def main():
        async with httpx.AsyncClient(base_url=limited.url, timeout=WAIT) as http:
            chat = asyncio.create_task(http.post("/v1/chat/completions", headers=JSON, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
            assert await asyncio.to_thread(entered.wait, WAIT)
            health = await http.get("/health", timeout=10)  # on the event loop this would wait for the template
            completion = await http.post("/v1/completions", headers=JSON, json={"prompt": "x", "max_tokens": 2},
                                         timeout=10)
            release.set()
            return health, completion, await chat

    health, completion, chat = asyncio.run(main())
    assert health.status_code == completion.status_code == chat.status_code == 200


@pytest.mark.parametrize("template,message", [
    ("{{ cycler.__init__.__globals__.os.getcwd() }}", "unsafe"),  # reached os before the sandbox
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('the first message must be a system message') }}"
     "{% endif %}", "the first message must be a system message"),
    ("{{ messages.append({'role': 'system'}) }}", "unsafe"),  # templates may not change what they are given
])
def test_chat_templates_are_sandboxed(limited, monkeypatch, template, message):
    monkeypatch.setattr(limited.llm.tokenizer, "chat_template", template)
    response = post(limited, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    body = error(response, 400)
    assert message in body["message"] and body["param"] == "messages"
    assert limited.engine.health() is None


def test_internal_errors_are_not_shown_to_clients(limited, monkeypatch):
    """A request that breaks the engine gets a generic message (the details go to the log); another request in
    flight at the same time is not disturbed; an exception in a route is a generic 500 too."""
    real = step_module.params_tensors

    def params_tensors(params, repeats=None, device="cpu"):
        if any(p.seed == 666 for p in params):
            raise RuntimeError("secret internal detail")
        return real(params, repeats, device)

    monkeypatch.setattr(step_module, "params_tensors", params_tensors)
    bystander = {"prompt": "import os", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=limited.url, timeout=WAIT, headers=JSON) as http:
        with http.stream("POST", "/v1/completions", json=bystander) as stream:
            failed = http.post("/v1/completions", json={"prompt": "x", "temperature": 1.0, "seed": 666})
            events = [line for line in stream.iter_lines() if line.startswith("data:")]
    body = error(failed, 500)
    assert "secret" not in body["message"] and "error id" in body["message"]
    assert events[-1] == "data: [DONE]" and all("error" not in e for e in events)
    assert json.loads(events[-2][5:])["choices"][0]["finish_reason"] == "length"

    def broken(*args, **kwargs):
        raise RuntimeError("secret route detail")

    monkeypatch.setattr(limited.llm.tokenizer, "encode", broken)
    body = error(post(limited, "completions", {"prompt": "x"}), 500)
    assert "secret" not in body["message"] and "error id" in body["message"]


def test_health_reports_a_dead_engine(tiny_models):
    llm = LLM(tiny_models["target"], dtype="float32", max_num_seqs=1)
    with running_server(llm) as s:
        assert httpx.get(s.url + "/health").status_code == 200
        s.engine.shutdown()
        response = httpx.get(s.url + "/health")
        assert response.status_code == 503 and "not running" in response.json()["reason"]
        assert error(post(s, "completions", {"prompt": "x"}), 503)["message"]
