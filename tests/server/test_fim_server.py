"""Fill in the middle over HTTP: OpenAI's /v1/completions with suffix (the official openai client), and llama.cpp's
/infill and /completion with the bodies llama.vscode and Continue's llama.cpp provider send (their sources:
ggml-org/llama.vscode src/llama-server.ts createRequestPayload; continuedev/continue core/llm/llms/LlamaCpp.ts),
answered as llama.cpp's server answers (tools/server/server-task.cpp)."""
import json

import httpx
import openai
import pytest

from specdecode.engine.llm import LLM
from specdecode.model.fim import fim_ids, fim_tokens, infill_ids
from specdecode.sampling import SamplingParams
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
