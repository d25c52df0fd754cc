"""Tools (function calling) in the chat route. At start-up ToolCalling reads the model's chat template: whether it
writes tools into the prompt at all, and in which tool-call format its model answers, chosen by the call tags the
template itself writes (today Hermes / Qwen2.5's <tool_call>{"name": ..., "arguments": {...}}</tool_call>). Per
request it checks the tools, builds the grammar that makes tool_choice "required" or a named function always
produce a valid call of an offered function, and splits the model's text into content and OpenAI tool_calls, whole
or as it streams. A call cut short (max_tokens) is neither a call nor content: it is dropped.
"""
from __future__ import annotations

import dataclasses
import json
import uuid

from specdecode.errors import ConfigError
from specdecode.server.protocol import ChatCompletionRequest, FunctionDefinition, bad_request
from specdecode.speculation.grammar import JSON_LAYOUT, Grammar, lark_literal


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """A tool-call syntax whose calls are JSON objects {"name": ..., "arguments": {...}} between two tags."""

    name: str
    open: str
    close: str
    pad: str = "\n"
    """What the template writes inside the tags around the JSON, and between two calls."""

    def parse_call(self, body: str) -> ToolCall | None:
        """The call between the tags, or None if it is not one (not JSON, no name, arguments not an object)."""
        try:
            call = json.loads(body, parse_constant=_no_constant)
        except ValueError:  # JSONDecodeError, or NaN / Infinity, which a client's JSON could not hold
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))  # some Hermes fine-tunes say "parameters"
        if isinstance(arguments, str):  # arguments written as a JSON string, as OpenAI sends them
            try:
                arguments = json.loads(arguments, parse_constant=_no_constant)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))

    def call_grammar(self, functions: list[FunctionDefinition], several: bool, literal=json.dumps) -> str:
        """A Lark grammar (llguidance's, with %json) of answers made only of calls of these functions: one, or one
        or more when `several`; each call's arguments valid against its function's schema. The JSON is laid out
        as the template writes calls ({"name": ..., "arguments": ...}, json.dumps' spacing); each function's schema
        is its own %json root, so its "$ref"s resolve as its author meant. `literal` writes the tags as terminals
        (grammar.lark_literal: a tag that is one special token in the vocabulary is matched as that token)."""
        rules = []
        for i, function in enumerate(functions):  # names match FUNCTION_NAME: nothing in them needs escaping
            head = '{"name": "' + function.name + '", "arguments": '
            rules.append(f'call_{i}: {json.dumps(head)} arguments_{i} "}}"')
            rules.append(f"arguments_{i}: %json {json.dumps(arguments_schema(function))}")
        either = " | ".join(f"call_{i}" for i in range(len(functions)))
        call = (f"call: {literal(self.open)} {json.dumps(self.pad)} ({either}) {json.dumps(self.pad)} "
                f"{literal(self.close)}")
        # After a whole call the model may end its turn, whatever whitespace it writes first (Qwen2.5 writes "\n"
        # after </tool_call>: a grammar that required a call after every pad made it invent calls to max_tokens).
        end = f"{json.dumps(self.pad)}?"
        start = f"start: call ({json.dumps(self.pad)} call)* {end}" if several else f"start: call {end}"
        return "\n".join([start, call, *rules])


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
"""Hermes 2 Pro / Qwen2.5 / Qwen3: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one per call."""

FORMATS = (HERMES,)
"""The tool-call formats known, in the order a template is matched against them (by both tags in its source)."""


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def arguments_schema(function: FunctionDefinition) -> dict:
    """The JSON schema a call's arguments must follow: the function's parameters (an object; no parameters: the
    empty object), in json.dumps' layout unless the schema's own x-guidance says otherwise."""
    schema = dict(function.parameters) if function.parameters is not None else {
        "type": "object", "properties": {}, "additionalProperties": False}
    schema.setdefault("type", "object")
    schema.setdefault("x-guidance", JSON_LAYOUT)
    return schema


@dataclasses.dataclass
class ToolCall:
    """One call the model made, as OpenAI returns it."""

    name: str
    arguments: str
    """A JSON object, as a string."""
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        """The call in a message's tool_calls, or (with its index among the answer's calls) in a streamed delta."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class ToolCallParser:
    """Splits one answer into content and tool calls as its text arrives; the same on the whole text at once (so an
    answer streamed and the same answer whole agree, however the text was cut).

    A call is a block from the open tag to the close tag (or to the end of the answer) whose inside parse_call
    accepts; any other block closed by its tag is content, exactly as the model wrote it, and an unclosed one that
    is no whole call (a call cut by max_tokens) is dropped. Content is the text between calls, without
    the whitespace around each call; where calls stood between two pieces of content, one `pad` joins them. While
    streaming, text that may still turn out to begin a call (trailing whitespace, a partial open tag) waits for the
    next text, and a call is sent whole once its close tag arrives.
    """

    def __init__(self, format: ToolFormat):
        self.format = format
        self.pending = ""
        """Text not yet given out: a held-back tail of content, or the inside of the call being read."""
        self.inside = False
        """pending is the inside of a block whose open tag has been seen."""
        self.gap = ""
        """Whitespace between the content and the open tag of the block being read (content if it is no call)."""
        self.after_call = False
        """The last thing given out was a call: whitespace that follows it is dropped."""
        self.said = self.separate = False
        """Some content was given out; a call came after the last content (the next content starts with a pad)."""

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The content and the calls that `text` completes; final: the answer ends here (release everything)."""
        open_tag, close_tag = self.format.open, self.format.close
        self.pending += text
        content, calls = [], []
        while True:
            if self.inside:
                end = self.pending.find(close_tag)
                if end < 0 and not final:
                    break
                body, tail = (self.pending, "") if end < 0 else (self.pending[:end], close_tag)
                self.pending = self.pending[len(body) + len(tail):]
                call = self.format.parse_call(body)
                if call is None and end < 0:  # the answer ended inside a call (cut by max_tokens): not content
                    pass
                elif call is None:
                    self._say(content, self.gap + open_tag + body + tail)
                else:
                    calls.append(call)
                    self.separate = True
                self.inside, self.gap, self.after_call = False, "", call is not None
                continue
            if self.after_call:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    break
                self.after_call = False
            start = self.pending.find(open_tag)
            if start >= 0:
                before = self.pending[:start]
                kept = before.rstrip()
                self._say(content, kept)
                self.gap = before[len(kept):]
                self.pending = self.pending[start + len(open_tag):]
                self.inside = True
                continue
            cut = len(self.pending) - (0 if final else _held_back(self.pending, open_tag))
            self._say(content, self.pending[:cut])
            self.pending = self.pending[cut:]
            break
        return "".join(content), calls

    def _say(self, content: list[str], text: str) -> None:
        if text:
            if self.separate and self.said:
                content.append(self.format.pad)
            content.append(text)
            self.said, self.separate = True, False


def _held_back(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that could still grow into whitespace + `tag`: whitespace followed by
    a proper beginning of the tag."""
    partial = next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
    rest = text[:len(text) - partial]
    return len(text) - len(rest.rstrip())


def parse(text: str, format: ToolFormat) -> tuple[str, list[ToolCall]]:
    """A whole answer's content and calls."""
    return ToolCallParser(format).feed(text, final=True)


def finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's finish_reason for an answer that made `calls` calls: "tool_calls" when it ended by itself."""
    return "tool_calls" if calls and reason == "stop" else reason


@dataclasses.dataclass
class ToolPlan:
    """What a chat request's tools mean for its generation."""

    tools: list[dict]
    """The function definitions, as the chat template reads them (OpenAI's shape)."""
    format: ToolFormat | None
    """Split the answer into content and calls in this format; None: tool_choice "none", the text is content."""
    structured: dict | None
    """SamplingParams.structured that keeps the answer to calls (tool_choice "required" or a named function)."""


class ToolCalling:
    """What this server does with tools, decided once at start-up from the model's chat template."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.format, self.refusal = detect_format(tokenizer)
        """The template's tool-call format, or None and why tools are refused."""

    def plan(self, req: ChatCompletionRequest) -> ToolPlan | None:
        """None when the request offers no tools. Otherwise its tools checked (a 400 naming the field: this
        template has no tool syntax, a parameters schema that does not compile, response_format as well), with the
        constraint tool_choice asks for."""
        if self.format is None:
            if req.tools:
                raise bad_request(f"tools cannot be used with this model: {self.refusal}", "tools")
            for i, message in enumerate(req.messages):
                if message.tool_calls:
                    raise bad_request(f"tool calls cannot be shown to this model: {self.refusal}",
                                      f"messages.{i}.tool_calls")
        if not req.tools:
            return None
        mode, name = req.tool_mode()
        for i, tool in enumerate(req.tools):
            self._check_parameters(tool.function, f"tools.{i}.function.parameters")
        source = req.structured()[0]
        if source is not None and mode != "none":
            raise bad_request(f"{source} together with tools is not supported (the answer could not be both a call "
                              f"and that format); send tool_choice \"none\" or leave {source} out", source)
        structured = None
        if mode in ("required", "function"):
            functions = [t.function for t in req.tools if mode == "required" or t.function.name == name]
            several = mode == "required" and req.parallel_tool_calls is not False
            structured = {"grammar": self.format.call_grammar(
                functions, several, lambda text: lark_literal(text, self.tokenizer))}
        tools = [{"type": "function", "function": {key: value for key, value in (
                     ("name", t.function.name), ("description", t.function.description),
                     ("parameters", t.function.parameters)) if value is not None}} for t in req.tools]
        return ToolPlan(tools, self.format if mode != "none" else None, structured)

    def _check_parameters(self, function: FunctionDefinition, field: str) -> None:
        if function.parameters is not None and function.parameters.get("type", "object") != "object":
            raise bad_request(f"{field} must be the JSON schema of an object (the arguments), got type "
                              f"{function.parameters['type']!r}", field)
        try:
            Grammar({"json_schema": arguments_schema(function)}, self.tokenizer, self.vocab_size)
        except ConfigError as exc:
            raise bad_request(f"{field} is not a JSON schema this server can follow: {exc}", field) from None


PROBE = [{"role": "user", "content": "What is the weather in Paris?"}]
PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def detect_format(tokenizer) -> tuple[ToolFormat | None, str | None]:
    """(format, None) for a chat template that writes tools into the prompt, in a format FORMATS knows; else
    (None, why not). A template takes tools if it renders a conversation differently with them; its format is the
    first whose tags its source writes (that is how its model was taught to call)."""
    template = tokenizer.chat_template
    if not template:
        return None, "it has no chat template"
    try:
        plain = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True)
        offered = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tools=PROBE_TOOLS)
    except Exception as exc:  # the template's own error, whatever it raises
        return None, f"its chat template could not render a probe conversation with a tool ({exc})"
    if offered == plain:
        return None, "its chat template has no tool syntax (it renders the same with and without tools)"
    for format in FORMATS:
        if format.open in template and format.close in template:
            return format, None
    known = ", ".join(f"{f.name}: {f.open}...{f.close}" for f in FORMATS)
    return None, f"its chat template writes tools, but its tool-call format is not one this server parses ({known})"
