"""Open WebUI (open-webui/open-webui) - or any OpenAI-compatible chat UI - against the default server.

With a connection to `http://127.0.0.1:8000/v1`, backend/open_webui/routers/openai.py lists GET {url}/models and
offers each `data[].id`; a chat posts the UI's body (model, messages, stream: true, and the user's parameters) to
{url}/chat/completions and relays the stream, reading choices[0].delta.content and, from a chunk without choices,
`usage`. Beside each chat it runs tasks (routers/tasks.py): a title, tags and follow-ups, each one user message,
`stream: false`, the title with `max_completion_tokens` (1000 by default), reading choices[0].message.content. Its
Stop button closes the stream."""
import httpx

from specdecode.sampling import SamplingParams
from tests.server.conftest import WAIT, StepGate

from .conftest import openai_stream, sse_data

CHAT = [{"role": "user", "content": "Write a function that reverses a string."}]


def test_the_model_list_offers_the_served_name(served):
    models = httpx.get(served.url + "/v1/models", timeout=WAIT).json()
    assert [m["id"] for m in models["data"]] == [served.model]
    assert models["object"] == "list" and models["data"][0]["object"] == "model"


def test_a_chat_streams_and_its_usage_is_read_from_the_chunk_without_choices(served, offline):
    body = {"model": served.model, "messages": CHAT, "stream": True, "temperature": 0, "max_tokens": 32,
            "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=WAIT) as response:
        assert response.status_code == 200
        for chunk in openai_stream(sse_data(response.iter_lines())):
            choices = chunk.get("choices", [])
            if not choices:
                usage = chunk.get("usage")
                continue
            text += (choices[0].get("delta") or {}).get("content") or ""
    expected = offline.generate([offline.tokenizer.encode_chat(CHAT)],
                                SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert text == expected.text and usage["completion_tokens"] == len(expected.token_ids)


def test_the_title_tags_and_follow_up_tasks(served):
    """Three non-streamed single-message requests beside the chat. The title's max_completion_tokens is cut to 200
    here: the tiny model's context is 512 tokens (the pair's is 32k, where Open WebUI's 1000 fits)."""
    history = "USER: Write a function that reverses a string.\nASSISTANT: def rev(s): return s[::-1]"
    for task, extra in (("Generate a concise title for the chat history.", {"max_completion_tokens": 200}),
                        ("Generate 1-3 broad tags for the chat history as JSON.", {}),
                        ("Suggest 3 follow-up questions as JSON.", {})):
        body = {"model": served.model, "messages": [{"role": "user", "content": f"{task}\n{history}"}],
                "stream": False, **extra}
        response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=WAIT)
        assert response.status_code == 200, response.text
        assert isinstance(response.json()["choices"][0]["message"]["content"], str)


def test_the_stop_button_closes_the_stream_and_frees_the_request(served, monkeypatch):
    assert served.engine.wait_idle(WAIT)
    gate = StepGate(served.engine, monkeypatch)
    body = {"model": served.model, "messages": CHAT, "stream": True, "max_tokens": 300, "ignore_eos": True}
    with httpx.Client(timeout=WAIT) as http:
        with http.stream("POST", served.url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert gate.entered.wait(WAIT)
    assert gate.aborted.wait(WAIT), "the server did not notice the client leave"
    gate.opened.set()
    assert served.engine.wait_idle(WAIT)
    assert len(served.engine.scheduler.free) == served.llm.max_num_seqs
