"""The OpenAPI schema the server publishes at /openapi.json: FastAPI's, plus the request bodies that the routes parse
themselves (in worker threads, so FastAPI cannot see them), the answers, and OpenAI's error format for every 4xx.
Fuzzers (tests/server/test_fuzz.py, `specdecode bench fuzz`) generate requests from it."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from specdecode.server.limits import ServerLimits
from specdecode.sampling import MAX_LOGPROBS, MAX_N
from specdecode.server.protocol import (FUNCTION_NAME, LLAMA_SAMPLERS, MAX_LOGIT_BIAS, ChatCompletionRequest,
                                        CompletionRequest, InfillRequest, LlamaCompletionRequest)

REF = "#/components/schemas/{model}"


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None
    n_prompt_tokens: int | None = None
    """llama-server's, with type exceed_context_size_error: the prompt's length in tokens."""
    n_ctx: int | None = None
    """llama-server's, with type exceed_context_size_error: the context, in tokens."""


class ErrorResponse(BaseModel):
    """OpenAI's error format."""

    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The completions route's logprobs (when asked for): parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(BaseModel):
    """A /v1/completions answer (with "stream": true, server-sent events of the same shape, without usage)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCallOut(BaseModel):
    name: str
    arguments: str
    """A JSON object, as a string."""


class ToolCallOut(BaseModel):
    id: str
    type: str
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: str
    content: str | None
    """None when the answer is only tool calls."""
    tool_calls: list[ToolCallOut] | None = None
    """Present when the model called tools (then finish_reason is "tool_calls" if it ended by itself)."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    """A /v1/chat/completions answer (with "stream": true, server-sent chat.completion.chunk events)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class LlamaTimings(BaseModel):
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float


class LlamaCompletion(BaseModel):
    """A /completion or /infill answer in llama.cpp's own format (with "stream": true, server-sent events of partial
    answers with "stop": false, then this one with an empty content). response_fields selects some fields only."""

    content: str | None = None
    stop: bool | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    stop_type: str | None = None
    """"eos", "word" (a stop string, in stopping_word) or "limit" (n_predict)."""
    timings: LlamaTimings | None = None


class AppliedTemplate(BaseModel):
    """An /apply-template answer."""

    prompt: str
    """The chat template's rendering of the messages."""


ERRORS = {
    400: "the body is not a valid request (the message names the field), or asks for something unsupported",
    401: "the API key is missing or wrong",
    404: "the model named is not the one served",
    408: "the body did not arrive within --body-timeout",
    413: "the body is larger than --max-body-bytes",
    415: "the body is not JSON",
    499: "the client closed the request",
    503: "the server is overloaded (queue full) or its engine stopped; retry",
}
"""Status -> when a generation route answers it (always in OpenAI's error format)."""


def generation_route(request: type[BaseModel], answer: type[BaseModel]) -> dict:
    """Keyword arguments for a POST route decorator whose handler parses `request` itself."""
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": REF.format(model=request.__name__)}}}}},
        "responses": {200: {"model": answer, "description": "the answer, or server-sent events when \"stream\" is "
                                                            "true", "content": {"text/event-stream": {}}},
                      **{status: {"model": ErrorResponse, "description": why} for status, why in ERRORS.items()}},
    }


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def accepted_fields(model_name: str, vocab: int, context: int, limits: ServerLimits,
                    tools: bool = False, fim: bool = False) -> tuple[dict, dict, dict, dict]:
    """The values the server accepts, where the request models' types alone allow more (the routes check these
    after parsing): fields of both requests, of completions only, of chat only, of a chat message. With them the
    schema describes the bodies that are served, so that a fuzzer's valid requests reach the engine. tools: the
    model's chat template takes tools (server/tools.py); else tools, tool_choice and messages' tool_calls are
    refused. fim: the vocabulary has fill-in-the-middle tokens (model/fim.py); else a suffix must be empty."""
    stop = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    tokens = {"type": "integer", "minimum": 1, "maximum": max(1, context - 1)}
    ids = {"type": "array", "minItems": 1, "maxItems": limits.prompt_tokens(context),
           "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}
    text = {"type": "string", "minLength": 1}
    common = {
        "model": _nullable({"type": "string", "enum": [model_name]}),
        "temperature": _nullable({"type": "number", "minimum": 0}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": vocab}),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N}),
        "stop": {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": limits.max_stop_strings},
                           {"type": "null"}]},
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 10}),
        "logit_bias": _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                 "propertyNames": {"pattern": "^[0-9]+$"},
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
        "max_tokens": _nullable(tokens),
        "n_predict": _nullable(tokens),
        "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                 "maximum": vocab - 1}}),
        "samplers": _nullable({"enum": [list(LLAMA_SAMPLERS)]}),
    }
    completion = {
        "prompt": {"anyOf": [text, ids, {"type": "array", "items": text, "minItems": 1, "maxItems": 1},
                             {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}]},
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
        "best_of": _nullable({"type": "integer", "enum": [1]}),
        "suffix": _nullable({"type": "string"} if fim else {"type": "string", "maxLength": 0}),
    }
    chat = {
        "messages": {"type": "array", "items": {"$ref": REF.format(model="ChatMessage")}, "minItems": 1,
                     "maxItems": limits.max_messages},
        "max_completion_tokens": _nullable(tokens),
        "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),  # see install()
    }
    message = {}
    if tools:
        named = {"type": "object", "required": ["type", "function"],
                 "properties": {"type": {"enum": ["function"]},
                                "function": {"type": "object", "required": ["name"],
                                             "properties": {"name": {"type": "string", "pattern": FUNCTION_NAME}}}}}
        chat["tool_choice"] = {"anyOf": [{"enum": ["none", "auto", "required"]}, named, {"type": "null"}]}
    else:
        chat["tools"] = _nullable({"type": "array", "maxItems": 0})
        chat["tool_choice"] = _nullable({"enum": ["none"]})
        message["tool_calls"] = {"type": "null"}
    return common, completion, chat, message


def install(app: FastAPI, accepted: tuple[dict, dict, dict, dict] | None = None) -> None:
    """Make app.openapi() (served at app.openapi_url) include the request models, narrowed to `accepted` (from
    accepted_fields) when given."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=_version(), routes=app.routes,
                                 description="OpenAI-compatible API with lossless speculative decoding")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            common, completion, chat, message = accepted or ({}, {}, {}, {})
            for model, own in ((CompletionRequest, completion), (ChatCompletionRequest, chat),
                               (LlamaCompletionRequest, {}), (InfillRequest, {})):
                body = model.model_json_schema(ref_template=REF)
                components.update(body.pop("$defs", {}))
                narrowing = {**common, **own} if model in (CompletionRequest, ChatCompletionRequest) else own
                for name, narrowed in narrowing.items():
                    body["properties"][name] = {**narrowed, "title": body["properties"][name].get("title", name)}
                if model is CompletionRequest:  # echo with logprobs is refused
                    body["if"] = {"properties": {"echo": {"const": True}}, "required": ["echo"]}
                    body["then"] = {"properties": {"logprobs": {"type": "null"}}}
                elif model is ChatCompletionRequest:  # top_logprobs only with logprobs: true
                    body["if"] = {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}
                    body["else"] = {"properties": {"top_logprobs": {"type": "null"}}}
                components[model.__name__] = body
            for name, narrowed in message.items():
                properties = components["ChatMessage"]["properties"]
                properties[name] = {**narrowed, "title": properties[name].get("title", name)}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdecode")
    except PackageNotFoundError:
        return "0"
