"""The API key guards every route the server has (each one found from the app itself, so a route added later is
covered without touching this file), in both header forms llama-server accepts, streamed routes included; only
liveness and the dashboard's data-free page and script stay open."""
import httpx
import pytest
from starlette.routing import Route

from specdecode.engine.llm import LLM
from specdecode.server.guard import OPEN_PATHS

from .conftest import running_server

KEY = "sk-the-right-key"

BODIES = {
    "/v1/completions": {"model": "tiny", "prompt": "x", "max_tokens": 2},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    "/completion": {"prompt": "x", "n_predict": 2},
    "/infill": {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 2},
    "/apply-template": {"messages": [{"role": "user", "content": "x"}]},
}
"""A request each generation route would answer, so that a right key is seen to let it through."""

WRONG = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": f"Bearer {KEY}x"},
    {"X-Api-Key": "wrong"},
    {"X-Api-Key": ""},
    {"Authorization": "Bearer wrong", "X-Api-Key": "also-wrong"},
]
RIGHT = [{"Authorization": f"Bearer {KEY}"}, {"Authorization": f"bearer {KEY}"}, {"X-Api-Key": KEY}]


@pytest.fixture(scope="module")
def keyed(tiny_models):
    llm = LLM(tiny_models["target"], dtype="float32", max_num_seqs=1)
    with running_server(llm, api_key=KEY) as s:
        yield s


def routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, HEAD aside (Starlette answers it as GET)."""
    found = [(method, route.path) for route in app.routes if isinstance(route, Route)
             for method in sorted(route.methods or ()) if method != "HEAD"]
    assert len(found) >= 10, found  # the generation routes, models, metrics, health, the dashboard, the schema
    return found


def call(server, method: str, path: str, headers: dict) -> httpx.Response:
    body = BODIES.get(path, {}) if method == "POST" else None
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=300)


def refused(response: httpx.Response) -> bool:
    if response.status_code != 401:
        return False
    assert response.json()["error"]["type"] == "authentication_error"
    assert response.headers["www-authenticate"] == "Bearer"
    return True


def test_every_guarded_route_refuses_a_missing_or_wrong_key(keyed):
    for method, path in routes(keyed.app):
        if path in OPEN_PATHS:
            continue
        for headers in WRONG:
            assert refused(call(keyed, method, path, headers)), (method, path, headers)


def test_every_route_answers_the_right_key_in_either_header(keyed):
    for method, path in routes(keyed.app):
        for headers in RIGHT:
            response = call(keyed, method, path, headers)
            expected = {"/infill": (200, 400), "/slots": (501,)}.get(path, (200,))  # no FIM tokens; slots off
            assert response.status_code in expected, \
                (method, path, headers, response.status_code, response.text[:200])


def test_only_liveness_and_the_dashboards_page_are_open(keyed):
    open_routes = [(m, p) for m, p in routes(keyed.app) if p in OPEN_PATHS]
    assert sorted(p for _, p in open_routes) == sorted(OPEN_PATHS)
    for method, path in open_routes:
        assert call(keyed, method, path, {}).status_code == 200
    # the page opens without the key, its data does not: the page sends the key it is given in its URL fragment
    assert refused(call(keyed, "GET", "/dashboard/data", {}))
    assert "location.hash" in httpx.get(keyed.url + "/dashboard/dashboard.js").text


def test_unknown_paths_and_the_schema_need_the_key(keyed):
    for path in ("/openapi.json", "/nowhere", "/v1/embeddings", "/props", "/slots"):
        assert refused(call(keyed, "GET", path, {})), path
        assert call(keyed, "GET", path, RIGHT[0]).status_code in (200, 404, 405, 501), path


def test_streamed_routes_refuse_before_the_first_event_and_stream_with_the_key(keyed):
    streamed = {"/v1/completions": "data: ", "/v1/chat/completions": "data: ", "/completion": "data: "}
    for path, prefix in streamed.items():
        body = {**BODIES[path], "stream": True}
        for headers, ok in [({}, False), ({"X-Api-Key": "wrong"}, False), ({"X-Api-Key": KEY}, True),
                            (RIGHT[0], True)]:
            with httpx.stream("POST", keyed.url + path, json=body, headers=headers, timeout=300) as response:
                text = response.read().decode()
            if ok:
                assert response.status_code == 200 and response.headers["content-type"].startswith(
                    "text/event-stream") and text.startswith(prefix), (path, headers, text[:200])
            else:
                assert response.status_code == 401 and "data:" not in text, (path, headers, text[:200])


def test_the_key_is_checked_before_the_body_is_read_or_judged(keyed):
    # a body that is not JSON, or too large, still gets the 401 (nothing about the request is told to a stranger)
    response = httpx.post(keyed.url + "/completion", content=b"not json", headers={"Content-Type": "text/plain"})
    assert refused(response)
    assert refused(httpx.post(keyed.url + "/infill", content=b"{", headers={"Content-Type": "application/json"}))


def test_preflights_are_not_asked_for_a_key(keyed):
    # browsers never send credentials in a CORS preflight; the guard lets OPTIONS through to the app
    response = httpx.options(keyed.url + "/v1/chat/completions", headers={"Origin": "http://localhost",
                                                                          "Access-Control-Request-Method": "POST"})
    assert response.status_code != 401
