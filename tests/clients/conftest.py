"""A server that stands in for `specdecode serve` with no flags, for replaying what real clients send: a tiny random
model with Qwen2.5-Coder's fill-in-the-middle tokens and a ChatML chat template, served under the default model's
name and drafting with a close copy of itself (so every answer goes through speculation). Model names are checked
strictly, so a request (or a documented example) naming another model fails here instead of being served anyway.

Reading helpers parse the replies the way the clients do (their sources are named in each test module)."""
import json

import pytest

from specdecode.catalog.registry import DEFAULT_MODEL
from specdecode.engine.llm import LLM
from tests.engine.fim_fixtures import fim_models  # noqa: F401 (fixture)
from tests.server.conftest import checkpoint_with_template, running_server

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen2.5's chat layout without its tool branches (the tiny vocabulary has no <|im_start|> token: it is text)."""


@pytest.fixture(scope="session")
def chat_target(fim_models, tmp_path_factory):
    return checkpoint_with_template(fim_models["target"], tmp_path_factory.mktemp("clients") / "target", CHATML)


@pytest.fixture(scope="session")
def offline(chat_target):
    """The same target without a server, plain decoding: what greedy answers must be (the server's engine owns its
    own LLM on another thread; a test must not drive that one)."""
    return LLM(chat_target, dtype="float32", max_num_seqs=1, max_model_len=512)


@pytest.fixture(scope="session")
def served(fim_models, chat_target):
    """The default model's name over the tiny FIM model, with a draft (4 tokens a step) and room for 8 requests."""
    llm = LLM(chat_target, dtype="float32", max_num_seqs=8, max_model_len=512,
              speculative_config={"model": str(fim_models["draft"]), "num_speculative_tokens": 4, "adaptive": False})
    with running_server(llm, model_name=DEFAULT_MODEL, strict_model_name=True) as server:
        yield server


def sse_data(lines) -> list[str]:
    """The payloads of a server-sent-event stream, read as the editors read it (Continue's streamSse, llama.vscode):
    line by line, `data:` lines only, each one complete JSON or `[DONE]`. A blank line separates events; anything
    else - a comment, an `event:` field, a payload split across lines - fails here, because those parsers would
    drop it or stop on it (Continue ends the stream at a `: ping` line)."""
    payloads, blank_before = [], True
    for line in lines:
        if not line:
            blank_before = True
            continue
        assert line.startswith("data: "), f"not a data line: {line!r}"
        assert blank_before, "two data lines in one event: line-by-line parsers read each as its own JSON"
        blank_before = False
        payload = line[len("data: "):]
        if payload != "[DONE]":
            json.loads(payload)  # raises: a payload that is not JSON on its own line
        payloads.append(payload)
    return payloads


def openai_stream(payloads: list[str]) -> list[dict]:
    """An OpenAI stream's chunks: it must end with exactly one `[DONE]`, nothing after it."""
    assert payloads and payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1, payloads[-3:]
    return [json.loads(p) for p in payloads[:-1]]
