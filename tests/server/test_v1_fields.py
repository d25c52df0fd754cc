"""Nothing a /v1 body holds is silently ignored (issue 60): a field the routes do not know is a 400 naming it; other
servers' fields that clients send anyway (llama-server's, vLLM's, OpenAI's own) are accepted at their defaults and
refused naming them otherwise; OpenAI's advisory fields are accepted and change nothing; llama-server's n_predict,
samplers and grammar and vLLM's stop_token_ids are honoured. llama.cpp's own routes keep their rule."""
import httpx
import pytest

from specdecode.sampling import SamplingParams

from .conftest import WAIT

PROMPT = "def add(a, b):"
ROUTES = {"/v1/completions": {"prompt": PROMPT, "max_tokens": 2},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=WAIT)


def refused(response: httpx.Response, field: str) -> str:
    """The 400's message, checked to name the field (as its param too) on one line."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"] and "\n" not in error["message"], error
    assert error["type"] == "invalid_request_error"
    return error["message"]


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("path", ROUTES)
def test_an_unknown_field_is_a_400_naming_it(server, path):
    message = refused(post(server, path, {**ROUTES[path], "foo": 1}), "foo")
    assert "leave it out" in message


@pytest.mark.parametrize("extra, field", [
    ({"messages": [{"role": "user", "content": PROMPT, "foo": 1}]}, "messages.0.foo"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT, "foo": 1}]}]},
     "messages.0.content.0.foo"),
    ({"stream": True, "stream_options": {"include_usage": True, "foo": 1}}, "stream_options.foo"),
])
def test_an_unknown_field_inside_a_chat_body_is_a_400_naming_its_place(server, extra, field):
    refused(post(server, "/v1/chat/completions", {**ROUTES["/v1/chat/completions"], **extra}), field)


DEFAULTS_ONLY = [
    # llama-server's (LLAMA_UNSUPPORTED, the rule of its own routes), what llama.vscode's chat edit sends
    ("typical_p", 1, 0.5), ("mirostat", 0, 2), ("repeat_penalty", 1.0, 1.3), ("dry_multiplier", 0, 0.8),
    ("id_slot", -1, 0), ("timings_per_token", False, True),
    # llama-server's, which its routes here implement but a /v1 answer cannot carry
    ("n_probs", 0, 3), ("return_tokens", False, True), ("t_max_predict_ms", -1, 500),
    # vLLM's
    ("use_beam_search", False, True), ("include_stop_str_in_output", False, True),
    ("skip_special_tokens", True, False), ("chat_template_kwargs", {}, {"enable_thinking": False}),
    # OpenAI's
    ("modalities", ["text"], ["text", "audio"]), ("prediction", None, {"type": "content", "content": "x"}),
]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("field, default, other", DEFAULTS_ONLY, ids=[f for f, _, _ in DEFAULTS_ONLY])
def test_a_field_implemented_only_at_its_default(server, path, field, default, other):
    plain = text(post(server, path, {**ROUTES[path], "temperature": 0}))
    for value in (default, None):  # null is the default, as OpenAI reads it
        assert text(post(server, path, {**ROUTES[path], "temperature": 0, field: value})) == plain
    message = refused(post(server, path, {**ROUTES[path], field: other}), field)
    assert "not supported" in message and ("default" in message or default is None)


ADVISORY = {"user": "u-1", "safety_identifier": "s-1", "metadata": {"team": "a"}, "store": True,
            "service_tier": "flex", "prompt_cache_key": "k", "cache_prompt": False, "t_max_prompt_ms": 500}


@pytest.mark.parametrize("path", ROUTES)
def test_advisory_fields_are_accepted_and_change_nothing(server, path):
    body = {**ROUTES[path], "max_tokens": 6, "temperature": 0}
    assert text(post(server, path, {**body, **ADVISORY})) == text(post(server, path, body))
    chunks = httpx.post(server.url + path, json={**body, "stream": True, "stream_options": {
        "include_usage": True, "include_obfuscation": False}}, timeout=WAIT)
    assert chunks.status_code == 200 and '"usage"' in chunks.text


def test_an_answer_sent_back_as_it_came_is_taken(server):
    """A client that appends the answer's message to the conversation sends OpenAI's empty fields with it."""
    answered = {"role": "assistant", "content": "Hi.", "refusal": None, "annotations": [], "audio": None,
                "function_call": None}
    messages = [{"role": "user", "content": "hi"}, answered, {"role": "user", "content": PROMPT}]
    assert post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}).status_code == 200
    messages[1] = {**answered, "refusal": "I can't."}
    refused(post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}), "messages.1.refusal")


@pytest.mark.parametrize("path", ROUTES)
def test_n_predict_is_max_tokens(server, path):
    body = {k: v for k, v in ROUTES[path].items() if k != "max_tokens"}
    answer = post(server, path, {**body, "n_predict": 5, "ignore_eos": True, "temperature": 0})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5
    assert post(server, path, {**body, "n_predict": 5, "max_tokens": 5, "ignore_eos": True}).status_code == 200
    refused(post(server, path, {**body, "n_predict": 5, "max_tokens": 6}), "n_predict")
    refused(post(server, path, {**body, "n_predict": 0}), "n_predict")


@pytest.mark.parametrize("path", ROUTES)
def test_samplers_as_llama_vscode_sends_them(server, path):
    for samplers in ("edkypmxt", ["top_k", "top_p", "min_p", "temperature"], ["top_k", "top_p", "infill"]):
        assert post(server, path, {**ROUTES[path], "samplers": samplers}).status_code == 200, samplers
    for samplers in ("tk", ["temperature", "top_k"], "edkypmxta", ["mirostat"]):
        refused(post(server, path, {**ROUTES[path], "samplers": samplers}), "samplers")


def test_stop_token_ids_end_the_answer(server, reference):
    free = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    stop = free.token_ids[2]
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop]}
    answer = post(server, "/v1/completions", body).json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == free.token_ids.index(stop) + 1
    refused(post(server, "/v1/completions", {**body, "stop_token_ids": [10 ** 6]}), "stop_token_ids")


def test_llama_grammar_on_v1_completions(server):
    answer = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "grammar": 'root ::= "a"{5,5}'})
    assert text(answer) == "aaaaa"


def test_the_published_schema_says_unknown_fields_are_refused(server):
    components = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    for model in ("CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions"):
        assert components[model]["additionalProperties"] is False, model


def test_llama_routes_keep_their_rule(server):
    """/completion ignores fields llama.cpp does not define (as llama.cpp does) and refuses LLAMA_UNSUPPORTED's away
    from llama.cpp's defaults, as before."""
    body = {"prompt": PROMPT, "n_predict": 2}
    assert post(server, "/completion", {**body, "foo": 1, "typical_p": 1, "samplers": "kt"}).status_code == 200
    message = refused(post(server, "/completion", {**body, "typical_p": 0.5}), "typical_p")
    assert "llama.cpp's default 1.0" in message
