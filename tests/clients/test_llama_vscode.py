"""llama.vscode (ggml-org/llama.vscode) against the default server: the bodies its src/llama-server.ts builds
(createRequestPayload for /infill, with and without prediction; createChatEditRequestPayload and
createChatRequestPayload for its chat features), and what it reads back. src/completion.ts takes `content` of a 200
answer (anything else is "no suggestion"), and its status line (src/statusbar.ts, showInfo) reads `tokens_cached`,
`generation_settings.n_ctx` - dereferencing generation_settings without a null check - and timings' prompt_n,
prompt_ms, prompt_per_second, predicted_n, predicted_ms and predicted_per_second. After showing a suggestion it asks
again at once for what follows it (cacheFutureSuggestion: the same prefix, the prompt extended by the suggestion),
and while the user edits it posts the other files alone with n_predict 0 (updateExtraContext) to warm the cache."""
import httpx
import pytest

from specdecode.model.fim import fim_tokens, infill_ids
from specdecode.sampling import SamplingParams

PREFIX = "import os\n\ndef add(a, b):\n"
LINE = "    return"
SUFFIX = "\n\nfor i in range(10):\n    print(add(i, i))\n"
CHUNKS = [{"text": "class Point:\n    def __init__(self, x, y):\n        self.x = x\n", "time": 1733600000000,
           "filename": "point.py"}]
"""Its ring buffer of other files' chunks ({text, time, filename}: extra-context.ts), sent as input_extra."""


def completion_body(prompt: str, n_predict: int = 24, **over) -> dict:
    """createRequestPayload(false, ...) with the extension's defaults (n_predict 128 cut to 24 here for time)."""
    return {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": CHUNKS, "prompt": prompt,
            "n_predict": n_predict, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, **over}


def warm_up_body() -> dict:
    """createRequestPayload(true, "", "", chunks, "", undefined): the other files only, nothing to predict."""
    return {"input_prefix": "", "input_suffix": "", "input_extra": CHUNKS, "prompt": "", "n_predict": 0,
            "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1}


def status_line(data: dict) -> str:
    """What showInfo builds from an answer: a missing generation_settings would throw (TypeError) there."""
    timings = data.get("timings") or {}
    n_ctx = data["generation_settings"].get("n_ctx") or 0
    return (f"c: {data['tokens_cached']} / {n_ctx} | p: {timings.get('prompt_n')} "
            f"({timings.get('prompt_ms'):.2f} ms, {timings.get('prompt_per_second'):.2f} t/s) | "
            f"g: {timings.get('predicted_n')} ({timings.get('predicted_ms'):.2f} ms, "
            f"{timings.get('predicted_per_second'):.2f} t/s)")


def test_a_completion_is_read_as_llama_vscode_reads_it(served, offline):
    response = httpx.post(served.url + "/infill", json=completion_body(LINE), timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    assert isinstance(data["content"], str)
    assert isinstance(data["generation_settings"], dict)
    assert "p: " in status_line(data)
    tok = offline.tokenizer
    ids = infill_ids(tok, fim_tokens(tok), PREFIX, SUFFIX, LINE, [(c["filename"], c["text"]) for c in CHUNKS])
    assert data["timings"]["prompt_n"] == len(ids) and data["tokens_cached"] >= len(ids)
    assert data["timings"]["predicted_n"] == data["tokens_predicted"] <= 24


def test_the_middle_is_the_engines_greedy_middle(served, offline):
    """At temperature 0 (the extension sends none: llama.cpp's default 0.8 samples) the middle is exactly the
    engine's own, n_indent and the time limit aside."""
    tok = offline.tokenizer
    fim = fim_tokens(tok)
    ids = infill_ids(tok, fim, PREFIX, SUFFIX, LINE, [(c["filename"], c["text"]) for c in CHUNKS])
    body = completion_body(LINE, temperature=0, n_indent=0, t_max_predict_ms=0)
    data = httpx.post(served.url + "/infill", json=body, timeout=60).json()
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=list(fim.stop_ids))
    assert data["content"] == offline.generate([ids], params)[0].outputs[0].text


def test_the_warm_up_and_the_follow_up_it_sends_beside_each_suggestion(served):
    warm = httpx.post(served.url + "/infill", json=warm_up_body(), timeout=60)
    assert warm.status_code == 200, warm.text
    assert warm.json()["content"] == "" and warm.json()["tokens_predicted"] == 0
    first = httpx.post(served.url + "/infill", json=completion_body(LINE, temperature=0), timeout=60).json()
    suggestion = first["content"].split("\n")
    # cacheFutureSuggestion: one line -> the prompt grows by it; several -> the prefix takes all but the last.
    if len(suggestion) > 1:
        follow = completion_body(suggestion[-1], temperature=0,
                                 input_prefix=PREFIX + LINE + "\n".join(suggestion[:-1]) + "\n")
    else:
        follow = completion_body(LINE + suggestion[0], temperature=0)
    again = httpx.post(served.url + "/infill", json=follow, timeout=60)
    assert again.status_code == 200 and isinstance(again.json()["content"], str)


def test_a_refused_body_is_a_non_200_the_extension_shows_as_no_suggestion(served):
    """getFIMCompletion returns undefined unless the status is 200; a body llama.cpp would refuse is a 4xx here."""
    response = httpx.post(served.url + "/infill", json=completion_body(LINE, n_predict="many"), timeout=60)
    assert 400 <= response.status_code < 500 and "error" in response.json()


def test_its_chat_edit_body(served):
    """createChatEditRequestPayload sends llama.cpp's sampler settings and "max_tokens": -1 (until the end) on
    /v1/chat/completions, and reads choices[0].message.content."""
    edit = {"messages": [{"role": "system", "content": "You are an expert coder."},
                         {"role": "user", "content": "Modify the code: add type hints.\n\ndef add(a, b):\n"}],
            "stream": False, "cache_prompt": True, "samplers": "edkypmxt", "temperature": 0.8, "dynatemp_range": 0,
            "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1,
            "xtc_probability": 0, "xtc_threshold": 0.1, "repeat_last_n": 64, "repeat_penalty": 1,
            "presence_penalty": 0, "frequency_penalty": 0, "dry_multiplier": 0, "dry_base": 1.75,
            "dry_allowed_length": 2, "dry_penalty_last_n": -1, "max_tokens": -1, "timings_per_token": False}
    response = httpx.post(served.url + "/v1/chat/completions", json=edit, timeout=120)
    assert response.status_code == 200, response.text
    assert isinstance(response.json()["choices"][0]["message"]["content"], str)


def test_its_chat_body(served):
    """createChatRequestPayload: system and user message, temperature 0.8, the configured model name; no limit."""
    chat = {"messages": [{"role": "system", "content": "You are an expert coder."},
                         {"role": "user", "content": "What does this do?\n\ndef add(a, b):\n    return a + b\n"}],
            "stream": False, "temperature": 0.8, "model": served.model}
    response = httpx.post(served.url + "/v1/chat/completions", json=chat, timeout=120)
    assert response.status_code == 200, response.text
    assert isinstance(response.json()["choices"][0]["message"]["content"], str)
