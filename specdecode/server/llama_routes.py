"""llama-server's routes beyond generation (tools/server/server-context.cpp), for clients written against its
README: its unprefixed aliases of the /v1 routes, /tokenize and /detokenize, and the read-only /props."""
from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from specdecode.server.protocol import APIError, bad_request, parse
from specdecode.server.schema import ErrorResponse

ALIASES = {"/completions": "/completion", "/chat/completions": "/v1/chat/completions", "/models": "/v1/models"}
"""llama-server's path -> the route that answers it (its /completions is its own /completion, not /v1's)."""


class Aliases:
    """ASGI middleware: an alias is the /v1 route itself (same handler, same guard, one entry in the schema), so the
    path is rewritten before routing rather than registered twice."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] in ALIASES:
            target = ALIASES[scope["path"]]
            scope = {**scope, "path": target, "raw_path": target.encode()}
        await self.app(scope, receive, send)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    content: str | None = None
    """The text to tokenize; absent: no tokens (as llama-server answers)."""
    add_special: bool = False
    """Prepend BOS where the tokenizer's config asks for it."""
    parse_special: bool = True
    """Special tokens written in the text become their ids (the tokenizer always does this: false is refused)."""
    with_pieces: bool = False
    """Answer [{"id", "piece"}] instead of ids: the piece as text, or its byte values when not valid UTF-8."""

    def check_supported(self) -> None:
        if not self.parse_special:
            raise bad_request("parse_special: false is not supported (special tokens in the text are always parsed)",
                              "parse_special")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    tokens: list[int] | None = None
    """Token ids to turn back into text, special tokens included; absent: empty content."""

    def check_supported(self) -> None:
        pass


def _body_route(request: type[BaseModel]) -> dict:
    """Keyword arguments for a POST route whose handler parses `request` itself: the schema shows its body."""
    return {"openapi_extra": {"requestBody": {"required": True, "content": {
                "application/json": {"schema": request.model_json_schema()}}}},
            "responses": {400: {"model": ErrorResponse, "description": "a field is wrong (the error names it)"}}}


def install(app: FastAPI, llm, model_name: str, build_info: str) -> None:
    """Add /tokenize, /detokenize and /props to app, and llama-server's aliases in front of it."""
    app.add_middleware(Aliases)
    tokenizer = llm.tokenizer
    vocab = llm.target.config.vocab_size

    def piece(token: int) -> str | list[int]:
        raw = tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: llama-server sends the byte values
            return list(raw)

    def tokenize(body: bytes) -> dict:
        req = parse(TokenizeRequest, body)
        ids = [] if req.content is None else tokenizer.encode(req.content, add_special_tokens=req.add_special)
        return {"tokens": [{"id": t, "piece": piece(t)} for t in ids] if req.with_pieces else ids}

    def detokenize(body: bytes) -> dict:
        req = parse(DetokenizeRequest, body)
        tokens = req.tokens or []
        if any(not 0 <= t < vocab for t in tokens):
            raise bad_request(f"tokens must be ids in [0, {vocab})", "tokens")
        return {"content": tokenizer.decode(tokens, skip_special_tokens=False)}

    @app.post("/tokenize", **_body_route(TokenizeRequest))
    async def tokenize_route(request: Request):
        return await run_in_threadpool(tokenize, await request.body())

    @app.post("/detokenize", **_body_route(DetokenizeRequest))
    async def detokenize_route(request: Request):
        return await run_in_threadpool(detokenize, await request.body())

    props = {
        "default_generation_settings": {"n_ctx": llm.max_model_len},
        "total_slots": llm.max_num_seqs,
        "model_alias": model_name,
        "model_path": str(llm.model_dir),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": False,
        "endpoint_props": False,
        "chat_template": tokenizer.chat_template or "",
        "bos_token": tokenizer.bos_token or "",
        "eos_token": tokenizer.eos_token or "",
        "build_info": build_info,
        "is_sleeping": False,
    }

    @app.get("/props")
    async def props_route():
        return props

    @app.get("/slots", include_in_schema=False)
    async def slots():
        """Off, as llama-server's is unless started with --slots (its test_server_slots expects the 501)."""
        raise APIError(501, "This server does not support slots endpoint", type="not_supported_error")
