"""aider (Aider-AI/aider) against the default server, as `aider --openai-api-base URL --model openai/NAME` calls it.

aider/models.py Model.send_completion builds litellm.completion(model, messages, stream, temperature) - temperature
0 unless the model's settings say otherwise, no stop sequences, no max_tokens, no stream_options - and litellm's
openai provider posts that through the official openai client with the `openai/` prefix removed from the name.
The main turn streams; aider/coders/base_coder.py reads each chunk's choices[0].delta.content, skips chunks without
choices, and treats finish_reason "length" as "the reply was cut". Commit messages and chat-history summaries go
through simple_send_with_retries: stream false, reading choices[0].message.content. The edit format ("whole",
"diff") changes only the prompt (the system prompt, its examples, the files) and how aider parses the text, so the
two formats are two prompts here; the reply must be the model's own text, untouched."""
import openai
import pytest

from specdecode.sampling import SamplingParams

FILE = "def add(a, b):\n    return a + b\n"
WHOLE = [{"role": "system", "content": "Act as an expert software developer. Return every changed file whole, "
                                       "its name on a line of its own, then its content in a fenced block."},
         {"role": "user", "content": f"add.py\n```\n{FILE}```"},
         {"role": "assistant", "content": "Ok."},
         {"role": "user", "content": "Add type hints to add."}]
DIFF = [{"role": "system", "content": "Act as an expert software developer. Describe each change as a search and "
                                      "replace block: the file name, <<<<<<< SEARCH, the lines to find, =======, "
                                      "the lines to put instead, >>>>>>> REPLACE."},
        {"role": "user", "content": "Change get_factorial to use math.factorial"},
        {"role": "assistant", "content": "mathweb/app.py\n```python\n<<<<<<< SEARCH\nfrom flask import Flask\n"
                                         "=======\nimport math\nfrom flask import Flask\n>>>>>>> REPLACE\n```"},
        {"role": "user", "content": f"add.py\n```\n{FILE}```\nAdd type hints to add."}]


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)  # OPENAI_API_KEY=x


def stream_reply(served, messages) -> tuple[str, str | None]:
    """send_completion(stream=True) and base_coder's loop over the chunks."""
    stream = client(served).chat.completions.create(model=served.model, messages=messages, stream=True,
                                                    temperature=0, timeout=600)
    text, finish = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        text += chunk.choices[0].delta.content or ""
    return text, finish


@pytest.mark.parametrize("messages", [WHOLE, DIFF], ids=["whole", "diff"])
def test_an_edit_turn_streams_the_models_own_reply(served, offline, messages):
    text, finish = stream_reply(served, messages)
    prompt = offline.tokenizer.encode_chat(messages)
    room = offline.max_model_len - len(prompt)  # no max_tokens: the reply may run to the end of the context
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=room))[0].outputs[0]
    assert text == expected.text
    assert finish == expected.finish_reason  # "length" is what aider reports as a reply cut short


def test_the_commit_message_request(served, offline):
    """simple_send_with_retries: not streamed; aider reads choices[0].message.content (None would end it)."""
    messages = [{"role": "system", "content": "Write a one-line commit message for the diff."},
                {"role": "user", "content": "-def add(a, b):\n+def add(a: int, b: int) -> int:\n"}]
    reply = client(served).chat.completions.create(model=served.model, messages=messages, stream=False,
                                                   temperature=0, timeout=600)
    assert reply.choices and isinstance(reply.choices[0].message.content, str)
    prompt = offline.tokenizer.encode_chat(messages)
    room = offline.max_model_len - len(prompt)
    assert reply.choices[0].message.content == offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=room))[0].outputs[0].text


def test_a_prompt_past_the_context_is_a_400_that_litellm_maps_to_bad_request(served):
    """aider's exceptions table treats BadRequestError (and ContextWindowExceededError) as not worth a retry and
    shows the message: it must say what is too long."""
    messages = [{"role": "user", "content": "def add(a, b):\n    return a + b\n" * 200}]
    with pytest.raises(openai.BadRequestError) as caught:
        client(served).chat.completions.create(model=served.model, messages=messages, stream=True, temperature=0)
    assert "token" in caught.value.body["message"]
