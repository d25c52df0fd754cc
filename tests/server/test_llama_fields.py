"""llama-server's fields on its own routes and on /v1 (what llama.cpp's own server tests check, issue 60): token ids
and one event per token with n_probs, timings with the prefix cache's hits, logit_bias, GBNF grammar and json_schema
through the constrained decoding /v1 uses, fields refused rather than ignored, several prompts, the context overflow
error, /apply-template, CORS, the llamacpp:* metrics. Every generating test runs the same request with speculation on
and off (use_speculation) and wants the same bytes on the wire but for timings."""
import json

import httpx
import pytest

from specdecode.sampling import SamplingParams

from .conftest import WAIT, SpecCounts, running_server

PROMPT = "def add(a, b):"
DROPPED = ("timings", "generation_settings")
"""What differs between speculation on and off: times, and the settings echo (it says use_speculation)."""


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=WAIT)


def events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=WAIT) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def without(body: dict | list, keys=DROPPED):
    if isinstance(body, list):
        return [without(b, keys) for b in body]
    return {k: v for k, v in body.items() if k not in keys}


def same(a, b) -> bool:
    """Equal, but for log-probabilities within 1e-5: the tiny float32 models verify K + 1 tokens with other matrix
    shapes than plain decoding does (the quantized kernels are batch invariant; torch's float32 matmul is not)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-5
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def both_ways(server, path: str, body: dict, stream: bool = False, accepted: bool = True):
    """The answer (or events) with speculation on, after checking that off gives the same (timings aside).
    accepted: some draft token must have been accepted (the draft ignores a grammar, so under one it may not be)."""
    counts = SpecCounts(server)
    on = (events if stream else post)(server, path, {**body, "use_speculation": True})
    if accepted:
        counts.assert_speculated()
    else:
        assert counts.delta()["draft_tokens"] > 0, "no draft token was proposed: this tested plain decoding"
    off = (events if stream else post)(server, path, {**body, "use_speculation": False})
    if not stream:
        assert on.status_code == off.status_code == 200, on.text
        on, off = on.json(), off.json()
    assert same(without(on), without(off)), (on, off)
    return on


SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "seed": 11}]


def eos_banned(reference) -> dict[int, float]:
    """What llama.cpp's ignore_eos adds to a request's logit_bias."""
    return {t: -100.0 for t in reference.tokenizer.eos_token_ids}


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_completion_tokens_and_probabilities_with_and_without_speculation(server, reference, sampling):
    body = {"prompt": PROMPT, "n_predict": 12, "ignore_eos": True, "n_probs": 2, "return_tokens": True, **sampling}
    answer = both_ways(server, "/completion", body)
    assert len(answer["tokens"]) == 12 and answer["tokens_predicted"] == 12
    assert [p["id"] for p in answer["completion_probabilities"]] == answer["tokens"]
    assert reference.tokenizer.decode(answer["tokens"]) == answer["content"]
    if sampling["temperature"] == 0:
        offline = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                            logit_bias=eos_banned(reference)))
        assert answer["tokens"] == offline[0].outputs[0].token_ids


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_streamed_with_n_probs_one_event_per_token_with_and_without_speculation(server, sampling):
    body = {"prompt": PROMPT, "n_predict": 12, "ignore_eos": True, "n_probs": 3, **sampling}
    streamed = both_ways(server, "/completion", body, stream=True)
    pieces, last = streamed[:-1], streamed[-1]
    assert len(pieces) == 12 and last["stop"] is True
    for k, event in enumerate(pieces):
        assert len(event["tokens"]) == 1 and len(event["completion_probabilities"]) == 1
        assert event["completion_probabilities"][0]["id"] == event["tokens"][0]
        assert event["tokens_predicted"] == k + 1
    whole = post(server, "/completion", {**body, "return_tokens": True}).json()
    assert "".join(e["content"] for e in pieces) == whole["content"]
    assert [e["tokens"][0] for e in pieces] == whole["tokens"]


def test_streamed_events_carry_their_token_ids(server):
    """Without per-token data a step's tokens come in one event (batched), each event with its ids."""
    streamed = events(server, "/completion", {"prompt": PROMPT, "n_predict": 16, "ignore_eos": True,
                                              "temperature": 0})
    ids = [t for e in streamed[:-1] for t in e["tokens"]]
    whole = post(server, "/completion", {"prompt": PROMPT, "n_predict": 16, "ignore_eos": True, "temperature": 0,
                                         "return_tokens": True}).json()
    assert ids == whole["tokens"] and len(ids) == 16
    assert all(e["tokens"] for e in streamed[:-1])
    assert streamed[-1]["tokens"] == [] and whole["tokens_predicted"] == 16


def test_timings_count_the_prefix_cache(server):
    prompt = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 3
    body = {"prompt": prompt, "n_predict": 2, "temperature": 0}
    first, second = post(server, "/completion", body).json(), post(server, "/completion", body).json()
    assert second["timings"]["cache_n"] > 0
    for answer in (first, second):
        assert answer["timings"]["prompt_n"] + answer["timings"]["cache_n"] == answer["tokens_evaluated"]
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    post(server, "/v1/chat/completions", chat)
    usage = post(server, "/v1/chat/completions", chat).json()["usage"]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


def test_one_token_has_no_generation_rate(server):
    timings = post(server, "/completion", {"prompt": PROMPT, "n_predict": 1}).json()["timings"]
    assert timings["predicted_n"] == 1 and timings["predicted_per_second"] == timings["predicted_per_token_ms"] == 0


# -- logit_bias, grammar, json_schema on /completion -------------------------------------------------------------

@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_logit_bias_bans_tokens_with_and_without_speculation(server, reference, sampling):
    body = {"prompt": PROMPT, "n_predict": 10, "ignore_eos": True, "return_tokens": True, **sampling}
    free = post(server, "/completion", body).json()["tokens"]
    banned = sorted(set(free[:3]))
    for bias in ([[t, False] for t in banned], {str(t): -100 for t in banned}):
        answer = both_ways(server, "/completion", {**body, "logit_bias": bias})
        assert not set(answer["tokens"]) & set(banned)
        shown = {e["token"]: e["bias"] for e in answer["generation_settings"]["logit_bias"]}
        assert shown == {**{t: -100.0 for t in banned}, **eos_banned(reference)}
    if sampling["temperature"] == 0:  # the target's processed distribution, as offline generation applies it
        offline = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                            logit_bias={**{t: -100 for t in banned},
                                                                        **eos_banned(reference)}))
        assert answer["tokens"] == offline[0].outputs[0].token_ids


def test_logit_bias_text_biases_each_of_its_tokens(server, reference):
    text = " return a"
    tokens = reference.tokenizer.encode(text, add_special_tokens=False)
    answer = post(server, "/completion", {"prompt": PROMPT, "n_predict": 1, "logit_bias": [[text, 5]]}).json()
    assert answer["generation_settings"]["logit_bias"] == [{"bias": 5.0, "token": t} for t in dict.fromkeys(tokens)]


def test_ignore_eos_bans_the_end_tokens_as_llama_does(server, reference):
    """llama.cpp's ignore_eos biases its end tokens away (its generation_settings show them); vLLM's (on /v1) only
    goes on past one."""
    body = {"prompt": PROMPT, "n_predict": 4, "temperature": 0}
    assert post(server, "/completion", body).json()["generation_settings"]["logit_bias"] == []
    banned = post(server, "/completion", {**body, "ignore_eos": True}).json()["generation_settings"]["logit_bias"]
    assert banned == [{"bias": -100.0, "token": t} for t in reference.tokenizer.eos_token_ids] and banned


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_gbnf_grammar_on_completion_with_and_without_speculation(server, sampling):
    body = {"prompt": PROMPT, "n_predict": 12, "grammar": 'root ::= "a"{3,3} ("b" | "c")+', **sampling}
    answer = both_ways(server, "/completion", body, accepted=False)
    content = answer["content"]
    assert content.startswith("aaa") and set(content[3:]) <= {"b", "c"} and len(content) > 3


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_json_schema_on_completion_with_and_without_speculation(server, sampling):
    schema = {"type": "object", "properties": {"n": {"enum": [1, 22, 333]}}, "required": ["n"],
              "additionalProperties": False}
    answer = both_ways(server, "/completion", {"prompt": PROMPT, "n_predict": 24, "json_schema": schema, **sampling},
                       accepted=False)
    assert json.loads(answer["content"])["n"] in (1, 22, 333)
    streamed = both_ways(server, "/completion", {"prompt": PROMPT, "n_predict": 24, "json_schema": schema,
                                                 "n_probs": 1, **sampling}, stream=True, accepted=False)
    assert "".join(e["content"] for e in streamed) == answer["content"]


@pytest.mark.parametrize("body,field", [
    ({"grammar": "root ::= this is (not valid GBNF"}, "grammar"),
    ({"json_schema": {"type": "hiccup"}}, "json_schema"),
    ({"grammar": 'root ::= "a"', "json_schema": {}}, "json_schema"),
    ({"mirostat": 2}, "mirostat"),
    ({"typical_p": 0.5}, "typical_p"),
    ({"post_sampling_probs": True}, "post_sampling_probs"),
    ({"samplers": ["temperature", "top_k"]}, "samplers"),
    ({"logit_bias": [[5, "x"]]}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": {"prompt_string": "x", "multimodal_data": ["aGk="]}}, "prompt"),
])
def test_what_is_not_implemented_is_refused_naming_the_field(server, body, field):
    response = post(server, "/completion", {"prompt": PROMPT, "n_predict": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"] and "\n" not in error["message"]


def test_llama_defaults_of_unimplemented_fields_are_accepted(server):
    body = {"prompt": PROMPT, "n_predict": 2, "mirostat": 0, "typical_p": 1, "repeat_penalty": 1.0,
            "cache_prompt": False, "samplers": ["top_k", "top_p", "min_p", "temperature"], "id_slot": -1}
    assert post(server, "/completion", body).status_code == 200


def test_several_prompts_get_one_answer_each(server, reference):
    ids = reference.tokenizer.encode(PROMPT)
    body = {"n_predict": 5, "temperature": 0, "ignore_eos": True}
    single = post(server, "/completion", {**body, "prompt": PROMPT}).json()["content"]
    for prompt in ([ids, ids], [ids, PROMPT], [PROMPT, {"prompt_string": PROMPT}]):
        answers = post(server, "/completion", {**body, "prompt": prompt}).json()
        assert [a["content"] for a in answers] == [single, single]
    assert post(server, "/completion", {**body, "prompt": [ids, PROMPT], "stream": True}).status_code == 400


def test_context_overflow_says_how_large(server):
    response = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 5000}]})
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == server.llm.max_model_len and error["n_prompt_tokens"] > error["n_ctx"]
    assert "exceeds the available context size" in error["message"]


# -- /v1 fields, chat template, CORS, metrics -------------------------------------------------------------------

@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_chat_stream_opens_with_null_and_ends_with_a_bare_finish(server, sampling):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **sampling}
    chunks = events(server, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["delta"] == {}
    assert all(c["system_fingerprint"].startswith("b") for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["timings"]["predicted_n"] == 8 == usage["usage"]["completion_tokens"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    whole = post(server, "/v1/chat/completions", {**body, "stream_options": None}).json()
    assert text == whole["choices"][0]["message"]["content"] and whole["system_fingerprint"].startswith("b")


def test_chat_grammar_and_json_schema_fields(server):
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    answer = post(server, "/v1/chat/completions", {**base, "grammar": 'root ::= "a"{5,5}'}).json()
    assert answer["choices"][0]["message"]["content"] == "aaaaa"
    answer = post(server, "/v1/chat/completions", {**base, "json_schema": {"const": "42"}}).json()
    assert answer["choices"][0]["message"]["content"] == '"42"'
    answer = post(server, "/v1/chat/completions", {**base, "response_format": {"type": "json_object",
                                                                                "schema": {"const": "7"}}}).json()
    assert answer["choices"][0]["message"]["content"] == '"7"'
    for bad in ({"grammar": "root ::= (x"}, {"response_format": {"type": "json_object", "schema": 123}}):
        assert post(server, "/v1/chat/completions", {**base, **bad}).status_code == 400


def test_apply_template_and_continue_final_message(server, reference):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    prompt = post(server, "/apply-template", {"messages": messages[:1]}).json()["prompt"]
    assert prompt == reference.tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)
    continued = post(server, "/apply-template", {"messages": messages, "continue_final_message": True,
                                                 "add_generation_prompt": False}).json()["prompt"]
    assert continued.endswith("Hel")
    assert continued == reference.tokenizer.apply_chat_template(messages, add_generation_prompt=False)[
        :len(continued)]
    for body in ({"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
                 {"messages": messages[:1], "continue_final_message": True},
                 {"messages": messages + [{"role": "assistant", "content": "lo"}]}):
        assert post(server, "/v1/chat/completions", body).status_code == 400


def test_cors_is_off_unless_asked_for(server, tiny_models):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
    response = httpx.options(server.url + "/completion", headers=preflight)
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    from specdecode.engine.llm import LLM

    llm = LLM(tiny_models["target"], dtype="float32", max_num_seqs=1, max_model_len=64)
    with running_server(llm, cors_origins="localhost", api_key="k") as pages:
        for origin, allowed in (("http://localhost:3000", True), ("http://[::1]", True),
                                ("http://localhost.evil.com", False), ("http://evil.com", False)):
            response = httpx.options(pages.url + "/completion", headers={**preflight, "Origin": origin})
            assert response.status_code == 200
            assert response.headers.get("access-control-allow-origin") == (origin if allowed else None)
            if allowed:  # cased as llama-server writes it (its own tests read the headers into a plain dict)
                assert (b"Access-Control-Allow-Origin", origin.encode()) in response.headers.raw
            answer = httpx.get(pages.url + "/v1/models", headers={"Origin": origin, "X-Api-Key": "k"})
            assert answer.headers.get("access-control-allow-origin") == (origin if allowed else None)
        assert httpx.get(pages.url + "/v1/models", headers={"Origin": "http://localhost"}).status_code == 401


def test_llamacpp_metrics_follow_the_answers(server):
    def metrics() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics").text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line.startswith("llamacpp:")}

    assert any(name == b"Process-Start-Time-Unix" for name, _ in httpx.get(server.url + "/metrics").headers.raw)
    before = metrics()
    answers = [post(server, "/completion", {"prompt": PROMPT + " " * k, "n_predict": 3}).json() for k in range(2)]
    after = metrics()

    def grew(name: str) -> float:
        return after[f"llamacpp:{name}"] - before[f"llamacpp:{name}"]
    assert grew("tokens_predicted_total") == sum(a["timings"]["predicted_n"] for a in answers)
    assert grew("prompt_tokens_total") == sum(a["timings"]["prompt_n"] for a in answers)
    assert grew("prompt_tokens_cached_total") == sum(a["timings"]["cache_n"] for a in answers)
    assert after["llamacpp:requests_processing"] == 0 and grew("n_decode_total") > 0


# -- byte for byte on a real model --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_server(smollm2):
    """SmolLM2 through the quantized kernels, which compute every row the same whatever the pass's width: a verified
    draft gives the very numbers plain decoding does, so the answers must match byte for byte, probabilities too."""
    from specdecode.engine.llm import LLM

    llm = LLM("smollm2-135m-instruct", max_num_seqs=2, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    with running_server(llm, model_name="smollm2") as s:
        yield s


def raw_events(server, body: dict) -> list[bytes]:
    """The SSE events as sent, but for each one's timings (the one field that measures time)."""
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True}, timeout=WAIT) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    out = []
    for line in lines:
        event = json.loads(line[6:])
        event.pop("timings", None)
        event.get("generation_settings", {}).pop("use_speculation", None)
        out.append(json.dumps(event).encode())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_smollm2_same_bytes_with_and_without_speculation(smollm2_server, sampling):
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" \
             "def fibonacci(n):\n"  # repeats itself, so that prompt lookup drafts and is accepted
    body = {"prompt": prompt, "n_predict": 32, "n_probs": 2, "return_tokens": True, **sampling}
    counts = SpecCounts(smollm2_server)
    on = raw_events(smollm2_server, {**body, "use_speculation": True})
    counts.assert_speculated()
    off = raw_events(smollm2_server, {**body, "use_speculation": False})
    assert on == off and len(on) > 2
    whole = [post(smollm2_server, "/completion", {**body, "use_speculation": flag}).json() for flag in (True, False)]
    assert without(whole[0]) == without(whole[1])  # exactly: logprobs too
