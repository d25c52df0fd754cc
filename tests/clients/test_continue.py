"""Continue (continuedev/continue) against the default server, as its sources build and read the requests.

Chat, `provider: openai` (packages/openai-adapters/src/apis/OpenAI.ts, core/llm/openaiTypeConverters.ts toChatBody):
POST {apiBase}chat/completions with model, messages, max_tokens, temperature, top_p, frequency_penalty,
presence_penalty, stop, `stream: true` and `stream_options: {include_usage: true}` (modifyChatBody); the openai npm
client parses the stream, chunks carrying `usage` are held back and yielded last, and a chunk's text is
`choices?.[0]?.delta?.content` (fromChatCompletionChunk), so a usage chunk with empty choices must parse.

Autocomplete, `provider: openai` with a Qwen coder model: the prompt is rendered with its FIM template
(core/autocomplete/templating/AutocompleteTemplate.ts qwenCoderFimTemplate) and sent raw to the legacy
{apiBase}completions (OpenAI.ts _legacystreamComplete: `stream: true`, the stop words of getStopTokens.ts: the
template's nine, "\\n\\n", "\\r\\n\\r\\n", "/src/", "#- coding: utf-8", "```"), read by core/llm/stream.ts streamSse
(`data:` lines, `[DONE]` ends, a JSON `error` field throws) as `choices[0].text`. Each keystroke aborts the request
in flight. `provider: llama.cpp` (core/llm/llms/LlamaCpp.ts) streams /completion with n_predict, stop, top_k, top_p,
temperature, min_p and penalties, sends `Authorization: Bearer ${apiKey}` (the text "undefined" when no key is set),
and reads each event's `content`."""
import json

import httpx
import openai
import pytest

from specdecode.sampling import SamplingParams

from tests.server.conftest import WAIT, StepGate

from .conftest import openai_stream, sse_data

QWEN_FIM_STOPS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                  "<|repo_name|>", "<|file_sep|>", "<|im_start|>", "<|im_end|>"]
AUTOCOMPLETE_STOPS = QWEN_FIM_STOPS + ["\n\n", "\r\n\r\n", "/src/", "#- coding: utf-8", "```"]
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nfor i in range(10):\n    print(add(i, i))\n"
FIM_PROMPT = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"


def chat_body(served, **over) -> dict:
    """toChatBody + modifyChatBody for a chat turn (undefined fields are dropped by JSON.stringify)."""
    return {"messages": [{"role": "system", "content": "You are a helpful coding assistant."},
                         {"role": "user", "content": "Write a function that adds two numbers."}],
            "model": served.model, "max_tokens": 32, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **over}


def read_chat_stream(lines) -> tuple[str, dict | None]:
    """The adapter's loop: content of each chunk's first choice, usage from the chunk that carries it."""
    text, usage = "", None
    for chunk in openai_stream(sse_data(lines)):
        assert "error" not in chunk, chunk
        if chunk.get("usage"):
            usage = chunk["usage"]
            continue
        choices = chunk.get("choices") or []
        text += ((choices[0] if choices else {}).get("delta") or {}).get("content") or ""
    return text, usage


def test_chat_stream_with_usage_is_read_as_continue_reads_it(served, offline):
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=chat_body(served), timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text, usage = read_chat_stream(response.iter_lines())
    assert usage is not None and usage["completion_tokens"] > 0
    prompt = offline.tokenizer.encode_chat(chat_body(served)["messages"])
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert text == expected.text and usage["completion_tokens"] == len(expected.token_ids)
    assert usage["prompt_tokens"] == len(prompt)


def test_the_usage_chunk_has_empty_choices_and_comes_last(served):
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=chat_body(served), timeout=60) as response:
        chunks = openai_stream(sse_data(response.iter_lines()))
    assert chunks[-1]["choices"] == [] and set(chunks[-1]["usage"]) >= {"prompt_tokens", "completion_tokens"}
    assert all(c["choices"] and "usage" not in c for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_official_openai_client_that_continue_wraps_reads_the_same_stream(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    body = chat_body(served)
    stream = client.chat.completions.create(**{k: v for k, v in body.items() if k != "stream"}, stream=True)
    held, text = None, ""
    for chunk in stream:
        if chunk.usage:
            held = chunk
        else:
            text += chunk.choices[0].delta.content or ""
    assert held is not None and held.choices == [] and text


def test_autocomplete_through_the_openai_provider(served, offline):
    body = {"prompt": FIM_PROMPT, "model": served.model, "max_tokens": 24, "temperature": 0,
            "stop": AUTOCOMPLETE_STOPS, "stream": True}
    text = ""
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for chunk in openai_stream(sse_data(response.iter_lines())):
            if (chunk.get("choices") or [{}])[0].get("text") and chunk.get("finish_reason") != "eos":
                text += chunk["choices"][0]["text"]
    params = SamplingParams(temperature=0, max_tokens=24, stop=AUTOCOMPLETE_STOPS)
    expected = offline.generate([offline.tokenizer.encode(FIM_PROMPT)], params)[0].outputs[0]
    assert text == expected.text


def test_autocomplete_through_the_llama_cpp_provider_with_no_key_set(served, offline):
    body = {"prompt": FIM_PROMPT, "stream": True, "n_predict": 24, "frequency_penalty": 0, "presence_penalty": 0,
            "min_p": 0.05, "stop": AUTOCOMPLETE_STOPS, "top_k": 40, "top_p": 0.95, "temperature": 0}
    headers = {"Content-Type": "application/json", "Authorization": "Bearer undefined"}
    text = ""
    with httpx.stream("POST", served.url + "/completion", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        payloads = sse_data(response.iter_lines())
    assert "[DONE]" not in payloads  # llama.cpp's native routes end without it; streamSse stops at the body's end
    for payload in payloads:
        value = json.loads(payload)
        assert "error" not in value
        text += value.get("content") or ""
    params = SamplingParams(temperature=0, max_tokens=24, stop=AUTOCOMPLETE_STOPS)
    expected = offline.generate([offline.tokenizer.encode(FIM_PROMPT)], params)[0].outputs[0]
    assert text == expected.text


def test_a_keystroke_aborts_the_autocomplete_in_flight_and_the_next_one_is_served(served, monkeypatch):
    """Continue aborts the fetch of the last completion when the user types on: the connection closes mid-stream.
    The engine frees that request, and the next request (the prompt one character longer) is answered."""
    assert served.engine.wait_idle(WAIT)
    gate = StepGate(served.engine, monkeypatch)
    body = {"prompt": FIM_PROMPT, "model": served.model, "max_tokens": 200, "temperature": 0, "stream": True,
            "stop": AUTOCOMPLETE_STOPS, "ignore_eos": True}
    with httpx.Client(timeout=WAIT) as http:
        with http.stream("POST", served.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert gate.entered.wait(WAIT)  # being generated: the user types, the fetch is aborted
    assert gate.aborted.wait(WAIT), "the server did not notice the client leave"
    gate.opened.set()
    assert served.engine.wait_idle(WAIT)
    assert len(served.engine.scheduler.free) == served.llm.max_num_seqs
    body.update(prompt=FIM_PROMPT.replace(PREFIX, PREFIX + "r"), max_tokens=8, stream=False)
    response = httpx.post(served.url + "/v1/completions", json=body, timeout=WAIT)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("temperature", -1)])
def test_a_bad_request_is_a_4xx_whose_text_continue_shows(served, field, value):
    """streamResponse throws the body's text for any status but 200: it must say what was wrong."""
    response = httpx.post(served.url + "/v1/chat/completions", json=chat_body(served, **{field: value}), timeout=60)
    assert response.status_code == 400
    assert field in response.text and response.json()["error"]["message"]
