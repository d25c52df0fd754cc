"""Tools / function calling in the chat route, through the real server and the official openai client: a tiny random
model whose tokenizer has a tools-capable ChatML-style template (Hermes <tool_call> format) written here. Tools reach
the prompt; tool_choice "required" and a named function always give a valid call of an offered function, the same
whole and streamed, with and without speculation; a template without tool syntax refuses tools; bad tools are 400s
that name the field. The parser is tested alone on fixed text."""
import json
import random

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from specdecode.engine.llm import LLM
from specdecode.model.tokenizer import Tokenizer
from specdecode.server.tools import HERMES, ToolCallParser, detect_format, parse

from .conftest import SpecCounts, checkpoint_with_template, running_server

TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>You may call these functions. Write a call as <tool_call>\n"
    "{\"name\": <name>, \"arguments\": <object>}\n</tool_call>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}"
    "{% for call in m.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n"
    "</tool_call>\n{% endfor %}"
    "{%- elif m.role == 'tool' %}<|tool|><tool_response>{{ m.content }}</tool_response>\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")
"""ChatML-like, with Qwen2.5's tool syntax: tools as JSON lines in a system turn, calls in <tool_call> tags."""

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""SmolLM2-Instruct's template, in shape: ChatML with no tool syntax."""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "local_time", "description": "The time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                                    "utc": {"type": "boolean"}},
                   "required": ["city", "utc"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_model(tiny_models, tmp_path_factory):
    """The tiny target with TOOLS_TEMPLATE, and room for the tools: its small tokenizer writes JSON about one
    character a token (its rotary positions go on as well past the 512 it was made with; its weights are random)."""
    folder = checkpoint_with_template(tiny_models["target"], tmp_path_factory.mktemp("tools") / "target",
                                      TOOLS_TEMPLATE)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tool_server(tools_model):
    """Prompt lookup (the tool definitions in the prompt hold what a call writes), 4 tokens a step."""
    llm = LLM(tools_model, dtype="float32", max_num_seqs=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    with running_server(llm) as server:
        yield server


@pytest.fixture(scope="module")
def chatml_server(tiny_models, tmp_path_factory):
    folder = checkpoint_with_template(tiny_models["target"], tmp_path_factory.mktemp("chatml") / "target",
                                      SMOLLM2_TEMPLATE)
    with running_server(LLM(folder, dtype="float32", max_num_seqs=2)) as server:
        yield server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def tool_of(name: str) -> dict:
    return next(t for t in TOOLS if t["function"]["name"] == name)


def assert_valid_calls(calls, offered: list[dict]) -> list[tuple[str, dict]]:
    """Each call names an offered function and its arguments are valid against that function's schema."""
    assert calls, "no tool call"
    names = {t["function"]["name"]: t["function"]["parameters"] for t in offered}
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names, call.function.name
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, names[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed(c, **kwargs) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """(content, [(id, name, arguments)], finish_reason) of a streamed answer, assembled as a client does: tool-call
    deltas joined by their index."""
    content, calls, finish = [], {}, None
    state = ChatCompletionStreamState(input_tools=kwargs.get("tools", []))  # the client's own accumulator
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        state.handle_chunk(chunk)
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, ["", "", ""])
            call[0] += delta.id or ""
            call[1] += delta.function.name or ""
            call[2] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    final = state.current_completion_snapshot.choices[0]
    assert final.finish_reason == finish
    assert [(t.id, t.function.name, t.function.arguments) for t in final.message.tool_calls or []] == [
        tuple(calls[i]) for i in sorted(calls)]
    return "".join(content) or None, [tuple(calls[i]) for i in sorted(calls)], finish


def summary(message) -> tuple[str | None, list[tuple[str, str]]]:
    return message.content, [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


# -- the parser, on fixed text ---------------------------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>'


def test_parser_splits_content_and_calls():
    text = ("Let me look.\n" + CALL + "\n" + CALL.replace("Rome", "Oslo") + "\n<tool_call>\n{\"name\": broken\n"
            "</tool_call>\nDone.")
    content, calls = parse(text, HERMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome", "unit": "celsius"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    # the malformed block stays content as the model wrote it; whitespace around calls goes, one newline joins
    assert content == "Let me look.\n<tool_call>\n{\"name\": broken\n</tool_call>\nDone."
    assert len({c.id for c in calls}) == 2
    assert parse("no calls here, <tool ends like a tag  ", HERMES) == ("no calls here, <tool ends like a tag  ", [])
    assert parse(CALL + "\n\n", HERMES)[0] == ""
    # an answer that ends inside a call (no close tag): a call if its JSON is whole, else content
    content, calls = parse('x <tool_call>\n{"name": "f", "arguments": {"a": 1}}', HERMES)
    assert content == "x" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    # ... and a call cut short (max_tokens) is dropped: never content (it leaked into content as it was written)
    assert parse('<tool_call>{"name": "f", "argu', HERMES) == ("", [])
    assert parse('Sure. <tool_call>\n{"name": "f", "argu', HERMES) == ("Sure.", [])
    # not calls: no name, arguments not an object, NaN
    for body in ('{"arguments": {}}', '{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": {"a": NaN}}'):
        assert parse(f"<tool_call>{body}</tool_call>", HERMES) == (f"<tool_call>{body}</tool_call>", [])


def test_parser_gives_the_same_answer_however_the_text_is_cut():
    text = ("Sure.  \n" + CALL + "\n\n" + CALL.replace("Rome", "Paris") + " then <tool_call>{bad</tool_call> <tool"
            "\n  x <tool_call>\n{\"name\": \"local_time\", \"arguments\": {\"city\": \"Tokyo\", \"utc\": true}}")
    whole_content, whole_calls = parse(text, HERMES)
    assert len(whole_calls) == 3
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 40)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        parser, content, calls = ToolCallParser(HERMES), "", []
        for i, piece in enumerate(pieces):
            more, new = parser.feed(piece, final=i == len(pieces) - 1)
            content, calls = content + more, calls + new
        assert content == whole_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_the_format_is_chosen_from_the_template(tiny_models):
    tokenizer = Tokenizer(tiny_models["target"])
    assert detect_format(tokenizer)[0] is None and "no tool syntax" in detect_format(tokenizer)[1]
    tokenizer.chat_template = TOOLS_TEMPLATE
    assert detect_format(tokenizer) == (HERMES, None)
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    assert "no tool syntax" in detect_format(tokenizer)[1]
    tokenizer.chat_template = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}{{ messages[0].content }}"
    form, why = detect_format(tokenizer)
    assert form is None and "not one this server parses" in why and "<tool_call>" in why


# -- through the server ----------------------------------------------------------------------------------------------

def test_tools_are_rendered_into_the_prompt(tool_server):
    c = client(tool_server)
    tokenizer = tool_server.llm.tokenizer
    with_tools = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS)
    assert '{"name": "get_weather", "description": "The weather in a city."' in with_tools  # tojson, unescaped
    for choice in ("auto", "none"):  # "none": the model is told of the tools, its answer is not parsed
        out = c.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                        max_tokens=1)
        assert out.usage.prompt_tokens == len(tokenizer.encode(with_tools))
    plain = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert plain.usage.prompt_tokens == len(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES)))
    assert plain.usage.prompt_tokens < out.usage.prompt_tokens


def test_earlier_calls_and_tool_answers_reach_the_template(tool_server):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = client(tool_server).chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=1)
    rendered = tool_server.llm.tokenizer.apply_chat_template(
        [MESSAGES[0], {"role": "assistant", "content": "", "tool_calls": [{"function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
         {"role": "tool", "content": "21 degrees"}], tools=TOOLS)
    assert CALL.replace("Rome", "Paris") in rendered and "<tool_response>21 degrees</tool_response>" in rendered
    assert out.usage.prompt_tokens == len(tool_server.llm.tokenizer.encode(rendered))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "local_time"}}])
def test_forced_calls_are_valid_whole_streamed_and_with_or_without_speculation(tool_server, tool_choice):
    c = client(tool_server)
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                  max_tokens=200, temperature=0)
    counts = SpecCounts(tool_server)
    whole = c.chat.completions.create(**kwargs).choices[0]
    counts.assert_speculated()
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert len(whole.message.tool_calls) == 1
    (name, _), = assert_valid_calls(whole.message.tool_calls, TOOLS)
    if isinstance(tool_choice, dict):
        assert name == "local_time"
    content, calls, finish = streamed(c, **kwargs)
    assert (content, finish) == (None, "tool_calls")
    assert [(n, a) for _, n, a in calls] == summary(whole.message)[1] and calls[0][0].startswith("call_")
    plain = c.chat.completions.create(**kwargs, extra_body={"use_speculation": False}).choices[0]
    assert summary(plain.message) == summary(whole.message) and plain.finish_reason == "tool_calls"


def test_required_calls_are_valid_when_sampled(tool_server):
    c = client(tool_server)
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0)
    for seed in range(4):
        one = c.chat.completions.create(**kwargs, max_tokens=200, seed=seed, parallel_tool_calls=False).choices[0]
        assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1, one
        assert_valid_calls(one.message.tool_calls, TOOLS)
        # parallel calls allowed: the model may go on calling until max_tokens cuts one short (then finish_reason
        # is "length" and the cut call is dropped, never content); every whole call is valid
        several = c.chat.completions.create(**kwargs, max_tokens=300, seed=seed, n=2)
        for choice in several.choices:
            assert_valid_calls(choice.message.tool_calls, TOOLS)
            assert choice.finish_reason in ("tool_calls", "length") and not choice.message.content


def test_auto_answers_as_text_when_the_model_calls_nothing(tool_server):
    c = client(tool_server)
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0)
    whole = c.chat.completions.create(**kwargs).choices[0]
    # the random model writes no <tool_call>: its text is the content, and the answer is what "none" gives
    assert whole.message.tool_calls is None and whole.finish_reason in ("stop", "length")
    none = c.chat.completions.create(**kwargs, tool_choice="none").choices[0]
    assert whole.message.content == none.message.content
    assert streamed(c, **kwargs)[0] == whole.message.content


def test_a_template_without_tool_syntax_refuses_tools(chatml_server):
    response = httpx.post(chatml_server.url + "/v1/chat/completions", json={
        "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools" and "no tool syntax" in error["message"]
    history = MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]
    response = httpx.post(chatml_server.url + "/v1/chat/completions", json={"messages": history, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.1.tool_calls"
    ok = httpx.post(chatml_server.url + "/v1/chat/completions", json={
        "messages": MESSAGES, "tools": [], "tool_choice": "none", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def _function(**fields) -> dict:
    return {"type": "function", "function": {"name": "f", **fields}}


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "get weather"}}]}, "tools.1.function.name"),
    ({"tools": [_function(parameters={"type": "object", "properties": {"a": {"type": "strin"}}})]},
     "tools.0.function.parameters"),
    ({"tools": [_function(parameters={"type": "string"})]}, "tools.0.function.parameters"),
    ({"tools": [_function(parameters=[1])]}, "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tools_are_400s_naming_the_field(tool_server, body, param):
    response = httpx.post(tool_server.url + "/v1/chat/completions",
                          json={"messages": MESSAGES, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_published_schema_follows_the_template(tool_server, chatml_server):
    def chat_schema(server):
        components = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
        return components["ChatCompletionRequest"]["properties"], components["ChatMessage"]["properties"]

    fields, message = chat_schema(tool_server)
    assert "maxItems" not in json.dumps(fields["tools"]) and "required" in json.dumps(fields["tool_choice"])
    assert "Tool" in json.dumps(fields["tools"]) and "MessageToolCall" in json.dumps(message["tool_calls"])
    fields, message = chat_schema(chatml_server)
    assert fields["tools"]["anyOf"][0]["maxItems"] == 0 and message["tool_calls"]["type"] == "null"


@pytest.mark.slow
def test_fuzzed_tool_requests_get_no_5xx(tool_server):
    """The fuzzer, over the schema this server publishes (tools, tool_choice, messages with calls): no 5xx, every
    answer as the schema says."""
    pytest.importorskip("schemathesis")
    from specdecode.bench.fuzz import fuzz

    report = fuzz(tool_server.url, examples=15, seed=3, workers=2)
    assert report.failed == 0 and report.server_errors == 0, "\n".join(report.failures)
    assert report.statuses[200] > 0 and report.statuses[400] > 0, report.summary()


def test_a_tag_that_is_one_special_token_is_matched_as_that_token(tiny_models):
    """llguidance matches a special token only by id, never by its text: a call tag the tokenizer writes as one
    such token (Qwen2.5's <tool_call>) becomes `<[id]>` in the call grammar, other tags stay quoted text; a
    grammar with the quoted text would refuse the very token the model writes (a 500 on the real 1.5B)."""
    from specdecode.speculation.grammar import Grammar, lark_literal

    tokenizer = Tokenizer(tiny_models["target"])
    bos = tokenizer.encode("<|bos|>", add_special_tokens=False)
    assert len(bos) == 1 and lark_literal("<|bos|>", tokenizer) == f"<[{bos[0]}]>"
    assert lark_literal("<tool_call>", tokenizer) == '"<tool_call>"'
    for literal, accepted in ((lambda text: lark_literal(text, tokenizer), True), (json.dumps, False)):
        grammar = Grammar({"grammar": f'start: {literal("<|bos|>")} "x"'}, tokenizer, tokenizer.vocab_size)
        assert grammar.accepts([bos[0]]) is accepted


@pytest.mark.parametrize("parallel", [True, False])
def test_after_a_whole_call_the_grammar_lets_the_model_end_its_turn(tool_server, parallel):
    """tool_choice "required": after a whole call (and the newline Qwen2.5 writes after </tool_call>) the model may
    end its turn; the grammar used to demand another call after that newline, so the 1.5B invented cities until
    max_tokens cut a call short."""
    from specdecode.server.protocol import ChatCompletionRequest
    from specdecode.server.tools import ToolCalling
    from specdecode.speculation.grammar import Grammar

    llm = tool_server.llm
    vocab = llm.target.config.vocab_size
    request = ChatCompletionRequest(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=parallel)
    plan = ToolCalling(llm.tokenizer, vocab).plan(request)
    for written in (CALL, CALL + "\n"):
        grammar = Grammar(plan.structured, llm.tokenizer, vocab)
        ids = llm.tokenizer.encode(written, add_special_tokens=False)
        assert grammar.accepts(ids), written
        grammar.consume(ids)
        allowed = grammar.tree_masks([[]])[0]
        assert all(allowed[eos] for eos in llm.tokenizer.eos_token_ids), written
    grammar = Grammar(plan.structured, llm.tokenizer, vocab)
    next_call = llm.tokenizer.encode(CALL + "\n" + CALL, add_special_tokens=False)
    assert grammar.accepts(next_call) == parallel  # a second call only where parallel calls are allowed
