"""Fill in the middle over HTTP: OpenAI's /v1/completions with suffix (the official openai client), and llama.cpp's
/infill and /completion with the bodies llama.vscode and Continue's llama.cpp provider send (their sources:
ggml-org/llama.vscode src/llama-server.ts createRequestPayload; continuedev/continue core/llm/llms/LlamaCpp.ts),
answered as llama.cpp's server answers (tools/server/server-task.cpp)."""
import contextlib
import json

import httpx
import openai
import pytest
import torch

from specdecode.engine.llm import LLM, fim_params
from specdecode.model.fim import fim_ids, fim_tokens, infill_ids
from specdecode.sampling import SamplingParams
from specdecode.server.app import INFILL_MIDDLE_SHARE
from tests.engine.fim_fixtures import fim_models, qwen_coder  # noqa: F401 (fixtures)
from tests.server.conftest import SpecCounts, running_server

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nfor i in range(10):\n    print(add(i, i))\n"
EXTRA = [{"text": "class Point:\n    def __init__(self, x, y):\n        self.x = x\n", "filename": "point.py"}]


def vscode_body(**over) -> dict:
    """What llama.vscode posts to /infill for a completion (createRequestPayload(false, ...) with its defaults)."""
    return {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "return", "n_predict": 16,
            "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "n_indent": 4, **over}


@pytest.fixture(scope="module")
def fim_server(fim_models):
    llm = LLM(fim_models["target"], dtype="float32", max_num_seqs=4,
              speculative_config={"model": str(fim_models["draft"]), "num_speculative_tokens": 4, "adaptive": False})
    with running_server(llm) as s:
        yield s


@pytest.fixture(scope="module")
def offline(fim_models):
    return LLM(fim_models["target"], dtype="float32")


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy_middle(llm, ids, max_tokens, **extra):
    fim = fim_tokens(llm.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=list(fim.stop_ids), **extra)
    return llm.generate([ids], params)[0].outputs[0]


def test_openai_suffix_is_the_fim_prompt_streamed_or_not(fim_server, offline):
    counts = SpecCounts(fim_server)
    c = client(fim_server)
    answer = c.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=20, temperature=0,
                                  logprobs=2)
    expected = offline.generate(PREFIX, SamplingParams(temperature=0, max_tokens=20), suffix=SUFFIX)[0]
    choice = answer.choices[0]
    assert choice.text == expected.outputs[0].text and choice.finish_reason == expected.outputs[0].finish_reason
    assert answer.usage.prompt_tokens == len(fim_ids(offline.tokenizer, fim_tokens(offline.tokenizer), PREFIX, SUFFIX))
    assert len(choice.logprobs.tokens) == answer.usage.completion_tokens
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    streamed = c.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=20, temperature=0,
                                    stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == choice.text
    counts.assert_speculated()


def test_suffix_without_fim_tokens_is_a_clear_400(server):
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
    error = caught.value.body
    assert error["param"] == "suffix" and "fill-in-the-middle" in error["message"]
    assert "<|fim_prefix|>" in error["message"]
    assert client(server).completions.create(model="tiny", prompt=PREFIX, suffix="", max_tokens=2).choices
    infill = httpx.post(server.url + "/infill", json=vscode_body(), timeout=60)
    assert infill.status_code == 400 and "fill-in-the-middle" in infill.json()["error"]["message"]


def test_suffix_with_token_ids_is_refused(fim_server):
    with pytest.raises(openai.BadRequestError, match="must be text"):
        client(fim_server).completions.create(model="tiny", prompt=[5, 6, 7], suffix=SUFFIX, max_tokens=4)


def test_llama_vscode_infill_body_gets_llama_cpps_answer(fim_server, offline):
    tok = offline.tokenizer
    ids = infill_ids(tok, fim_tokens(tok), PREFIX, SUFFIX, "return", [(f["filename"], f["text"]) for f in EXTRA])
    answer = httpx.post(fim_server.url + "/infill", json=vscode_body(), timeout=60)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert isinstance(body["content"], str) and body["stop"] is True
    assert body["tokens_evaluated"] == len(ids) and body["prompt"] == tok.decode(ids, skip_special_tokens=False)
    assert body["prompt"].startswith("<|repo_name|>myproject\n<|file_sep|>point.py\nclass Point:")
    assert body["stop_type"] in ("eos", "limit") and 1 <= body["tokens_predicted"] <= 16
    timings = body["timings"]  # what llama.vscode shows in its status line
    for key in ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_second"):
        assert key in timings
    assert timings["prompt_n"] == len(ids) and timings["predicted_n"] == body["tokens_predicted"]
    assert body["tokens_cached"] >= len(ids) and body["truncated"] is False
    assert body["generation_settings"]["top_k"] == 40 and body["generation_settings"]["n_predict"] == 16


def test_infill_greedy_is_the_engines_greedy_middle_streamed_or_not(fim_server, offline):
    tok = offline.tokenizer
    ids = infill_ids(tok, fim_tokens(tok), PREFIX, SUFFIX, "return", [(f["filename"], f["text"]) for f in EXTRA])
    expected = greedy_middle(offline, ids, 24)
    body = httpx.post(fim_server.url + "/infill", json=vscode_body(temperature=0, n_predict=24), timeout=60).json()
    assert body["content"] == expected.text
    assert body["stop_type"] == ("eos" if expected.finish_reason == "stop" else "limit")
    events = []
    with httpx.stream("POST", fim_server.url + "/infill", json=vscode_body(temperature=0, n_predict=24, stream=True),
                      timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                assert line.startswith("data: ") and line != "data: [DONE]"  # llama.cpp sends no [DONE] here
                events.append(json.loads(line[6:]))
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert events[-1]["content"] == "" and events[-1]["timings"]["predicted_n"] == expected_count(expected)
    assert "".join(e["content"] for e in events) == expected.text


def expected_count(output) -> int:
    return len(output.token_ids)


def test_infill_warm_up_body_generates_nothing(fim_server):
    """llama.vscode's updateExtraContext: n_predict 0 with the other files only, to fill the cache."""
    body = {"input_prefix": "", "input_suffix": "", "input_extra": EXTRA, "prompt": "", "n_predict": 0,
            "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1}
    answer = httpx.post(fim_server.url + "/infill", json=body, timeout=60)
    assert answer.status_code == 200 and answer.json()["content"] == "" and answer.json()["tokens_predicted"] == 0


def test_continue_llama_cpp_provider_streams_completion(fim_server, offline):
    """Continue's llama.cpp provider renders the FIM template itself and streams /completion, reading content."""
    tok = offline.tokenizer
    prompt = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    body = {"prompt": prompt, "stream": True, "n_predict": 20, "temperature": 0, "top_k": 40, "top_p": 0.95,
            "min_p": 0.05, "stop": ["<|endoftext|>", "\n\n\n"], "frequency_penalty": 0, "presence_penalty": 0}
    expected = greedy_middle(offline, tok.encode(prompt), 20, stop=["<|endoftext|>", "\n\n\n"])
    text = ""
    with httpx.stream("POST", fim_server.url + "/completion", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                text += json.loads(line[6:]).get("content") or ""
    assert text == expected.text


def test_infill_logprobs_stop_words_and_response_fields(fim_server, offline):
    first = httpx.post(fim_server.url + "/infill", json=vscode_body(temperature=0, n_predict=12, n_probs=3),
                       timeout=60).json()
    probs = first["completion_probabilities"]
    assert len(probs) == first["tokens_predicted"]
    for p in probs:
        assert set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"} and len(p["top_logprobs"]) == 3
        assert p["logprob"] <= 0 and p["top_logprobs"][0]["logprob"] >= p["top_logprobs"][-1]["logprob"]
    assert [p["id"] for p in probs][0] == probs[0]["top_logprobs"][0]["id"]  # greedy: the most likely token
    word = first["content"][2:4]
    if len(word) == 2 and first["content"].find(word) == 2:
        cut = httpx.post(fim_server.url + "/infill", json=vscode_body(temperature=0, n_predict=12, stop=[word]),
                         timeout=60).json()
        assert cut["content"] == first["content"][:2]
        assert cut["stop_type"] == "word" and cut["stopping_word"] == word
    picked = httpx.post(fim_server.url + "/infill", json=vscode_body(
        temperature=0, n_predict=4, response_fields=["content", "timings/predicted_n"]), timeout=60).json()
    assert set(picked) == {"content", "timings/predicted_n"}


@pytest.mark.parametrize("body, param", [
    ({"input_suffix": ""}, "input_prefix"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a.py"}]}, "input_extra.0.text"),
    ({"input_prefix": "", "input_suffix": "", "n_predict": -2}, "n_predict"),
    ({"input_prefix": "", "input_suffix": "", "n_probs": 1000}, "n_probs"),
])
def test_bad_infill_bodies_are_400s(fim_server, body, param):
    answer = httpx.post(fim_server.url + "/infill", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param


@pytest.mark.slow
def test_qwen_coder_serves_fim_to_the_openai_client_and_llama_vscode(qwen_coder):
    """The real format on the real model: the middle of a function by suffix (the model card's prompt), and by
    /infill's body (llama.cpp's repo-level prompt), with prompt lookup drafting."""
    llm = LLM(qwen_coder, max_num_seqs=1, max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prefix, suffix = "def fibonacci(n):\n    ", "\n\nprint(fibonacci(10))\n"
    with running_server(llm, model_name="qwen") as s:
        answer = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0).completions.create(
            model="qwen", prompt=prefix, suffix=suffix, max_tokens=48, temperature=0)
        text = answer.choices[0].text
        assert answer.choices[0].finish_reason == "stop" and "fibonacci(n - 1)" in text.replace("n-1", "n - 1")
        assert answer.usage.prompt_tokens == len(llm.tokenizer.encode(
            f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"))
        infill = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 48, "temperature": 0}
        body = httpx.post(s.url + "/infill", json=infill, timeout=600).json()
        assert body["prompt"].startswith("<|repo_name|>myproject\n<|file_sep|>filename\n<|fim_prefix|>def fib")
        # Under llama.cpp's repo header the instruct model writes the same body, then goes on (the suffix again,
        # prose; llama.cpp's server writes the same), until n_predict...
        assert body["content"].startswith(text.rstrip()) and body["stop_type"] == "limit"
        # ... which llama.vscode's n_indent (the cursor line's indentation) cuts where the function ends.
        cut = httpx.post(s.url + "/infill", json={**infill, "n_indent": 4}, timeout=600).json()
        assert cut["content"].strip() == text.strip() and cut["stop_type"] == "limit"


def test_editor_limits_cut_as_llama_cpp():
    from specdecode.server.llama_native import EditorLimits

    indent = EditorLimits(n_indent=4)
    assert indent.cut("x = 1", 0, "x = 1") is None  # the first line is not checked
    assert indent.cut("x = 1\n    y = 2\n", 0, "") is None
    assert indent.cut("x = 1\n    y = 2\n  ", 0, "  ") is None  # nothing after the indentation yet
    assert indent.cut("x = 1\n    y = 2\n  z", 0, "z") == len("x = 1\n    y = 2\n  ")
    assert indent.cut("x = 1\n\n", 0, "\n") == len("x = 1\n")  # an empty line ends it too, as there
    timed = EditorLimits(t_max_predict_ms=100)
    assert timed.cut("a\nb", 0.2, "b") is None and timed.cut("a\nb\n", 0.05, "\n") is None
    assert timed.cut("a\nb\n", 0.2, "\n") == 4


def test_infill_n_indent_ends_the_middle_where_llama_cpp_would(fim_server):
    from specdecode.server.llama_native import EditorLimits

    whole = httpx.post(fim_server.url + "/infill", json=vscode_body(temperature=0, n_predict=40, n_indent=0,
                                                                     t_max_predict_ms=0), timeout=60).json()
    cut = EditorLimits(n_indent=2).cut(whole["content"], 0, whole["content"])
    limited = httpx.post(fim_server.url + "/infill", json=vscode_body(temperature=0, n_predict=40, n_indent=2,
                                                                       t_max_predict_ms=0), timeout=60).json()
    assert limited["content"] == whole["content"][:cut]
    if cut is not None:
        assert limited["stop_type"] == "limit"


END_TOKENS = ["<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
"""The tokens that end a middle besides the EOS (FimTokens.stop_ids of Qwen2.5-Coder's format)."""


@contextlib.contextmanager
def writing(token: int, bias: float, *llms):
    """The models of these LLMs (target, and draft when there is one) write `token` more readily: `bias` added to its
    logit by a hook on their output layer, as a model that ends its middles with that token."""
    handles = []
    for llm in llms:
        for model in (llm.target, getattr(llm.proposer, "model", None)):
            if model is not None:
                push = torch.zeros(model.config.vocab_size)
                push[token] = bias
                handles.append(model.lm_head.register_forward_hook(lambda module, args, logits, push=push:
                                                                   logits + push))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def least_bias_to_write(llm, ids: list[int], token: int) -> float:
    """The least bias (in steps of 0.5) under which the greedy continuation of ids, not stopped at the FIM end tokens,
    writes `token` within 24 tokens."""
    for bias in [step / 2 for step in range(1, 41)]:
        with writing(token, bias, llm):
            if token in llm.generate([ids], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].token_ids:
                return bias
    raise AssertionError(f"no bias up to 20 makes the model write token {token}")


@pytest.mark.parametrize("end", END_TOKENS)
def test_fim_through_the_server_stops_at_each_end_token_as_offline(fim_server, offline, end):
    """A model pushed to write one of the format's end tokens: suffix on /v1/completions (streamed and not) and
    /infill (streamed and not) end the middle there, with the text, tokens and finish reason of the offline LLM's
    FIM call on the same prompt. The server's draft model is pushed the same way, so its drafts can hold the end token
    too (with draft tokens after it that must not be kept)."""
    tok = offline.tokenizer
    fim = fim_tokens(tok)
    token = tok.get_vocab()[end]
    greedy = SamplingParams(temperature=0, max_tokens=24)

    ids = fim_ids(tok, fim, PREFIX, SUFFIX)
    with writing(token, least_bias_to_write(offline, ids, token), offline, fim_server.llm):
        expected = offline.generate(PREFIX, greedy, suffix=SUFFIX)[0].outputs[0]
        c = client(fim_server)
        answer = c.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=24, temperature=0,
                                      logprobs=1)
        streamed = list(c.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=24,
                                             temperature=0, stream=True, stream_options={"include_usage": True}))
    assert expected.token_ids[-1] == token and expected.finish_reason == "stop"
    choice = answer.choices[0]
    assert (choice.text, choice.finish_reason) == (expected.text, "stop")
    assert answer.usage.completion_tokens == len(expected.token_ids)
    assert choice.logprobs.tokens == [tok.decode([t]) for t in expected.token_ids]
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected.text
    assert [chunk.choices[0].finish_reason for chunk in streamed if chunk.choices][-1] == "stop"
    assert streamed[-1].usage.completion_tokens == len(expected.token_ids)

    files = [(f["filename"], f["text"]) for f in EXTRA]
    ids = infill_ids(tok, fim, PREFIX, SUFFIX, "return", files)
    body = vscode_body(temperature=0, n_predict=24, n_probs=1, n_indent=0, t_max_predict_ms=0)
    with writing(token, least_bias_to_write(offline, ids, token), offline, fim_server.llm):
        expected = offline.generate([ids], fim_params(greedy, fim))[0].outputs[0]
        answer = httpx.post(fim_server.url + "/infill", json=body, timeout=60).json()
        events = stream_events(fim_server.url + "/infill", {**body, "stream": True})
    assert expected.token_ids[-1] == token and expected.finish_reason == "stop"
    assert (answer["content"], answer["stop_type"], answer["stop"]) == (expected.text, "eos", True)
    assert answer["tokens_predicted"] == len(expected.token_ids)
    assert [p["id"] for p in answer["completion_probabilities"]] == expected.token_ids
    assert "".join(e["content"] for e in events) == expected.text
    assert [p["id"] for e in events[:-1] for p in e["completion_probabilities"]] == expected.token_ids
    assert events[-1]["stop_type"] == "eos" and events[-1]["tokens_predicted"] == len(expected.token_ids)


def stream_events(url: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                events.append(json.loads(line.removeprefix("data: ")))
    return events


REPEATED = "import os\n"
"""A line of a file, repeated to make files of a known size (7 tokens in the tiny models' vocabulary)."""


def fit_case(name: str, tok, fim, context: int) -> tuple[dict, int]:
    """(an /infill body, its prompt's expected length) for each edge of the fitting."""
    files = [("big.py", REPEATED * 40)]
    whole = len(infill_ids(tok, fim, PREFIX, SUFFIX, "return", files))
    assert context // 2 < whole < context - 8
    extra = [{"filename": f, "text": t} for f, t in files]
    if name == "fits exactly":
        return vscode_body(input_extra=extra, n_predict=context - whole), whole
    if name == "one token over":
        return vscode_body(input_extra=extra, n_predict=context - whole + 1), whole - 1
    if name == "many small files":
        small = [{"filename": f"f{i}.py", "text": f"x{i} = {i}\n"} for i in range(300)]
        return vscode_body(input_extra=small, n_predict=32), context - 32
    if name == "one huge file":
        return vscode_body(input_extra=[{"filename": "huge.py", "text": REPEATED * 3000}], n_predict=32), context - 32
    if name == "a prefix longer than the context":
        return vscode_body(input_prefix=PREFIX * 200, n_predict=32), context - 32
    if name == "no n_predict":
        body = vscode_body(input_extra=[{"filename": "huge.py", "text": REPEATED * 3000}])
        del body["n_predict"]
        return body, context - int(INFILL_MIDDLE_SHARE * context)
    raise ValueError(name)


@pytest.mark.parametrize("case", ["fits exactly", "one token over", "many small files", "one huge file",
                                  "a prefix longer than the context", "no n_predict"])
def test_infill_fits_its_prompt_to_leave_room_for_the_middle(fim_server, offline, case):
    """An /infill body too long for the context is trimmed (model/fim.py infill_ids: the other files first, then the
    prefix, then the suffix) to leave room for n_predict tokens, or INFILL_MIDDLE_SHARE of the context without one;
    never a 400. The answer is the offline greedy middle of the trimmed prompt."""
    tok = offline.tokenizer
    fim = fim_tokens(tok)
    context = fim_server.llm.max_model_len
    body, length = fit_case(case, tok, fim, context)
    body.update(temperature=0, n_indent=0, t_max_predict_ms=0)
    answer = httpx.post(fim_server.url + "/infill", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    answer = answer.json()
    files = [(f["filename"], f["text"]) for f in body.get("input_extra", [])]
    ids = infill_ids(tok, fim, body["input_prefix"], body["input_suffix"], body["prompt"], files, max_tokens=length)
    assert len(ids) == length and answer["tokens_evaluated"] == length
    assert answer["prompt"] == tok.decode(ids, skip_special_tokens=False)
    assert answer["prompt"].endswith(f"<|fim_suffix|>{SUFFIX}<|fim_middle|>")
    expected = greedy_middle(offline, ids, context - length if case == "no n_predict" else body["n_predict"])
    assert answer["content"] == expected.text and answer["tokens_predicted"] == len(expected.token_ids)


def test_infill_bodies_that_cannot_fit_are_400s(fim_server):
    """What trimming cannot fix: n_predict as long as the context, or typed text (the body's prompt, never cut)
    longer than it."""
    context = fim_server.llm.max_model_len
    answer = httpx.post(fim_server.url + "/infill", json=vscode_body(n_predict=context), timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n_predict"
    answer = httpx.post(fim_server.url + "/infill", json=vscode_body(prompt=REPEATED * 200), timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
