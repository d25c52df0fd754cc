"""Stop strings through the real server: streamed and non-streamed completions give the text offline `generate` gives
(the stop string cut off, nothing of it sent first), and usage counts the tokens up to the one that completed it,
with speculation and without."""
import openai
import pytest

from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams

from tests.engine.test_stop_strings import cut_at_stop, spanning_stops

from .conftest import running_server

PROMPTS = ["def add(a, b):", "for i", "import os\nimport sys\n"]
LONG = 32


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def plain_server(tiny_models):
    llm = LLM(tiny_models["target"], dtype="float32", max_num_seqs=2)
    with running_server(llm) as s:
        yield s


@pytest.fixture(scope="module")
def cases(reference):
    """(prompt, stop, (token ids, text) the oracle expects), from the offline greedy outputs."""
    out = []
    for prompt in PROMPTS:
        ids = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True))[0]
        ids = ids.outputs[0].token_ids
        out += [(prompt, stop, cut_at_stop(reference.tokenizer, ids, [stop])[:2])
                for stop in spanning_stops(reference.tokenizer, ids)[:3]]
    assert len(out) >= 6
    return out


def streamed(c, model: str, **request) -> tuple[str, str | None, int]:
    """(text, finish reason, usage.completion_tokens) of a streamed completion; checks that what arrived so far is
    always the start of what arrives in the end (request["expected"])."""
    expected = request.pop("expected")
    text, reason, usage = "", None, None
    for chunk in c.completions.create(model=model, stream=True, stream_options={"include_usage": True}, **request):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
            assert expected.startswith(text), f"{text!r} was sent but the answer is {expected!r}"
    return text, reason, usage


@pytest.mark.slow
@pytest.mark.parametrize("which", ["plain_server", "server"])
def test_streamed_and_whole_completions_stop_like_generate(request, which, cases):
    server = request.getfixturevalue(which)
    c = client(server)
    for prompt, stop, (want_ids, want_text) in cases:
        body = dict(prompt=prompt, max_tokens=LONG, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
        whole = c.completions.create(model=server.model, **body)
        assert (whole.choices[0].text, whole.choices[0].finish_reason) == (want_text, "stop"), stop
        assert whole.usage.completion_tokens == len(want_ids)
        assert streamed(c, server.model, expected=want_text, **body) == (want_text, "stop", len(want_ids))


@pytest.mark.parametrize("which", ["plain_server", "server"])
def test_chat_stops_like_generate_streamed_or_not(request, which, reference):
    server = request.getfixturevalue(which)
    c = client(server)
    messages = [{"role": "user", "content": "def add(a, b):"}]
    tokenizer = reference.tokenizer
    rendered = tokenizer.apply_chat_template(messages)  # the prompt the server builds
    prompt = tokenizer.encode(rendered, add_special_tokens=not rendered.startswith(tokenizer.bos_token))
    ids = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True))[0]
    ids = ids.outputs[0].token_ids
    for stop in spanning_stops(tokenizer, ids)[:3]:
        want_ids, want, _ = cut_at_stop(tokenizer, ids, [stop])
        body = dict(model=server.model, messages=messages, max_tokens=LONG, temperature=0, stop=[stop],
                    extra_body={"ignore_eos": True})
        whole = c.chat.completions.create(**body)
        assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (want, "stop")
        assert whole.usage.completion_tokens == len(want_ids)
        text, usage = "", None
        for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body):
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text += choice.delta.content or ""
                assert want.startswith(text), f"{text!r} was sent but the answer is {want!r}"
        assert (text, usage) == (want, len(want_ids))
