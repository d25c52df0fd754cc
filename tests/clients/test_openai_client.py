"""The official `openai` Python client against the default server: the calls docs/clients.md shows, and what the
client does with the answers - typed objects built from the JSON (a missing field fails there), streams parsed as
server-sent events up to `[DONE]`, the usage chunk (stream_options.include_usage) with an empty `choices`, and a
4xx raised as its exception class with the error body."""
import openai
import pytest

from specdecode.sampling import SamplingParams


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="sesame", max_retries=0)  # any key without --api-key


def test_completion_and_its_usage(served, offline):
    out = client(served).completions.create(model=served.model, prompt="def fibonacci(n):", max_tokens=16,
                                            temperature=0)
    expected = offline.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.completion_tokens == len(expected.token_ids) and out.model == served.model


def test_chat_streamed_with_usage_last(served, offline):
    messages = [{"role": "user", "content": "import json"}]
    stream = client(served).chat.completions.create(model=served.model, messages=messages, stream=True,
                                                    max_tokens=16, temperature=0,
                                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    expected = offline.generate([offline.tokenizer.encode_chat(messages)],
                                SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert text == expected.text and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_fill_in_the_middle_with_suffix(served, offline):
    out = client(served).completions.create(model=served.model, prompt="def area(r):\n    ",
                                            suffix="\n\nprint(area(2))\n", max_tokens=16, temperature=0)
    expected = offline.generate("def area(r):\n    ", SamplingParams(temperature=0, max_tokens=16),
                                suffix="\n\nprint(area(2))\n")[0].outputs[0]
    assert out.choices[0].text == expected.text


@pytest.mark.parametrize("call, param", [
    (lambda c, m: c.completions.create(model=m, prompt="x", max_tokens=0), "max_tokens"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}], top_p=2),
     "top_p"),
    (lambda c, m: c.completions.create(model="gpt-4o", prompt="x", max_tokens=4), "model")])
def test_a_bad_request_raises_the_clients_error_with_the_field(served, call, param):
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as caught:
        call(client(served), served.model)
    assert caught.value.body["param"] == param and caught.value.body["message"]
