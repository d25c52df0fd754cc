"""The OpenAI-compatible HTTP API over an AsyncEngine: /v1/completions (with OpenAI's suffix: fill in the middle),
/v1/chat/completions (both with "stream": true as server-sent events), /v1/models, /health, Prometheus /metrics and
the live /dashboard (with /dashboard/data, server/dashboard.py); and llama.cpp's own /completion and /infill, which
code editors call (server/llama_native.py), with llama-server's aliases, /tokenize, /detokenize and /props
(server/llama_routes.py).

Every request is checked before the engine sees it (Guard: host, key, content type, body size; ServerLimits and
the request models: everything else); anything wrong is a 4xx in OpenAI's error format. Parsing, chat template
rendering and tokenisation run in worker threads, so a heavy request never stalls the other clients' streams.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.engine.async_engine import (AsyncEngine, EngineDead, EngineOverloaded, RequestAborted,
                                            RequestFailed, RequestStream)
from specdecode.engine.llm import fim_params
from specdecode.errors import ConfigError
from specdecode.model.fim import fim_ids, fim_tokens, infill_ids, require_fim
from specdecode.sampling import SamplingParams, choice_seed
from specdecode.server.cors import Cors, CorsPolicy
from specdecode.server.guard import LOCAL_HOSTS, Guard
from specdecode.speculation.grammar import Grammar
from specdecode.server.limits import ServerLimits
from specdecode.server import dashboard, llama_metrics, llama_native, llama_routes, schema, tools
from specdecode.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, InfillRequest,
                                        LlamaCompletionRequest, bad_request, parse)

MAX_PROMPT_CHARS_PER_TOKEN = 64
"""Prompts longer than this many characters per allowed prompt token are refused before tokenisation."""
INFILL_MIDDLE_SHARE = 0.25
"""Share of the context an /infill body without n_predict keeps for the middle: its prompt is trimmed to the rest."""

log = logging.getLogger("specdecode.server")


@dataclasses.dataclass
class Prepared:
    """A request checked, tokenised and turned into sampling parameters, ready for the engine."""

    req: CompletionRequest | ChatCompletionRequest
    ids: list[int]
    params: SamplingParams
    echo: str = ""
    """Completions with echo: the prompt text to send back first."""
    grammar: "Grammar | None" = None
    """A structured request's grammar, compiled in the worker thread that prepared it (each choice gets a copy)."""
    tool_plan: tools.ToolPlan | None = None
    """A chat request's tools (rendered, how its answer is parsed); None when it offers none."""


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None, limits: ServerLimits | None = None,
              allowed_hosts: list[str] | None = None, strict_model_name: bool = False,
              cors_origins: str | None = None) -> FastAPI:
    """allowed_hosts: names the Host header may carry (default: localhost, 127.0.0.1 and ::1; "*" = any).
    strict_model_name: a request naming another model gets 404 (vLLM's answer); else it is served by the one model
    (llama-server's). cors_origins: the web pages that may call it (server/cors.py; None: none)."""
    limits = limits or ServerLimits()
    cors = CorsPolicy(cors_origins)
    app = FastAPI(title="specdecode", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.add_middleware(Guard, limits=limits, allowed_hosts=list(allowed_hosts or LOCAL_HOSTS), api_key=api_key,
                       cors=cors)
    llm = engine.llm
    vocab = llm.target.config.vocab_size
    max_prompt = limits.prompt_tokens(llm.max_model_len)
    tool_calling = tools.ToolCalling(llm.tokenizer, vocab)  # what the chat template does with tools, probed once
    fim = fim_tokens(llm.tokenizer)  # None: the model cannot fill in the middle (suffix and /infill are refused)
    schema.install(app, schema.accepted_fields(model_name, vocab, llm.max_model_len, limits,
                                               tools=tool_calling.format is not None, fim=fim is not None))
    created = int(time.time())
    fingerprint = f"b{schema._version()}-specdecode"  # llama-server's is b<build>-<commit>; clients check the "b"

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type="invalid_request_error").body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        error_id = uuid.uuid4().hex[:12]
        log.error("request to %s failed (error %s)", request.url.path, error_id, exc_info=exc)
        return JSONResponse(APIError(500, f"internal error (error id {error_id} in the server's log)",
                                     type="internal_error").body(), status_code=500)

    @app.get("/health", responses={503: {"description": "the engine is not running (the reason says why)"}})
    @app.get("/v1/health", include_in_schema=False)  # llama-server's alias
    async def health():
        problem = engine.health()
        if problem is not None:
            return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)
        return {"status": "ok"}

    started = int(time.time())

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        """Ours (specdecode:*, vLLM's names), then llama-server's (llamacpp:*) from the same counters."""
        body = engine.metrics.render() + llama_metrics.render(engine.metrics.samples())
        response = Response(body, media_type=CONTENT_TYPE_LATEST)
        response.raw_headers.append((b"Process-Start-Time-Unix", str(started).encode()))  # llama-server's casing
        return response

    dashboard.install(app, engine, model_name)
    llama_routes.install(app, llm, model_name, f"specdecode {schema._version()}")
    app.add_middleware(Cors, policy=cors)  # outermost: a preflight is answered before the key is asked for

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "specdecode", "max_model_len": llm.max_model_len}]}

    # -- preparation (worker threads) -----------------------------------------------------------------------

    def check(req) -> None:
        if strict_model_name and req.model is not None and req.model != model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        limits.check_request(req, vocab)

    def prepared(req, ids: list[int], max_tokens: int | None, logprobs: int | None, echo: str = "",
                 plan: tools.ToolPlan | None = None) -> Prepared:
        """The request's sampling parameters and, for structured output, its compiled grammar (the request's own, or
        the one its tool_choice asks for)."""
        source, structured = ("tool_choice", plan.structured) if plan and plan.structured else req.structured()
        params = sampling_params(req, len(ids), max_tokens, logprobs, source, structured)
        grammar = None
        if params.structured is not None:  # compile it here, in the worker thread: a bad one is this request's 400
            try:
                grammar = Grammar(params.structured, llm.tokenizer, vocab)
            except ConfigError as exc:
                raise bad_request(str(exc), source) from None
        return Prepared(req, ids, params, echo, grammar, plan)

    def sampling_params(req, prompt_len: int, max_tokens: int | None, logprobs: int | None, source: str | None,
                        structured: dict | None) -> SamplingParams:
        room = llm.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = room
        if isinstance(max_tokens, int) and max_tokens > room:
            raise bad_request(f"this model's context is {llm.max_model_len} tokens; the prompt has {prompt_len} "
                              f"and max_tokens is {max_tokens}: ask for at most {room} tokens or shorten the prompt",
                              "max_tokens")
        fields = {"max_tokens": max_tokens, "stop": req.stop, "seed": req.seed, "ignore_eos": req.ignore_eos,
                  "use_speculation": req.use_speculation, "sampler": req.sampler, "logprobs": logprobs,
                  "n": 1 if req.n is None else req.n}
        fields["logit_bias"] = req.token_bias(vocab)
        if any(not 0 <= token < vocab for token in req.stop_token_ids or []):
            raise bad_request(f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")
        fields["stop_token_ids"] = req.stop_token_ids or None
        fields["structured"] = structured
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if getattr(req, name) is not None:
                fields[name] = getattr(req, name)
        try:
            return SamplingParams(**fields)
        except ConfigError as exc:  # its messages start with the field's name
            field = str(exc).split(" ", 1)[0]
            if field == "structured":
                raise bad_request(str(exc), source) from None
            raise bad_request(str(exc), field if field in fields else None) from None

    def tokenize(prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("the prompt is empty", "prompt")
            if len(prompt) > MAX_PROMPT_CHARS_PER_TOKEN * max_prompt:
                raise bad_request(f"the prompt is longer than the {max_prompt} tokens this server accepts", "prompt")
            ids = llm.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = prompt
            if len(ids) <= max_prompt and any(not 0 <= t < vocab for t in ids):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        if len(ids) > max_prompt:
            raise APIError(400, f"the request exceeds the available context size: the prompt has {len(ids)} tokens "
                                f"but this server accepts at most {max_prompt} (the model's context is "
                                f"{llm.max_model_len}); shorten the prompt", type="exceed_context_size_error",
                           param="prompt", n_prompt_tokens=len(ids), n_ctx=llm.max_model_len)
        return ids

    def prepare_completion(body: bytes) -> Prepared:
        req = parse(CompletionRequest, body)
        check(req)
        prompt = req.single_prompt()
        if req.suffix:
            ids = fill_in_the_middle(prompt, req.suffix)
        else:
            ids = tokenize(prompt)
        echo = (prompt if isinstance(prompt, str) else llm.tokenizer.decode(ids)) if req.echo else ""
        ready = prepared(req, ids, req.token_limit(), req.logprobs, echo)
        if req.suffix:
            ready.params = fim_params(ready.params, fim)
        return ready

    def fill_in_the_middle(prompt: str | list[int], suffix: str) -> list[int]:
        """The model card's FIM prompt of a completion with a suffix (the prompt is the text before the middle)."""
        need_fim("suffix")
        if not isinstance(prompt, str):
            raise bad_request("a prompt with a suffix must be text (the code before the insertion point), not token "
                              "ids", "prompt")
        if len(prompt) + len(suffix) > MAX_PROMPT_CHARS_PER_TOKEN * max_prompt:
            raise bad_request(f"the prompt and suffix are longer than the {max_prompt} tokens this server accepts",
                              "prompt")
        return tokenize(fim_ids(llm.tokenizer, fim, prompt, suffix))

    def need_fim(what: str) -> None:
        try:
            require_fim(llm.tokenizer, what)
        except ConfigError as exc:
            raise bad_request(str(exc), "suffix" if what == "suffix" else "input_prefix") from None

    def prepare_native(body: bytes, infill: bool) -> list[Prepared]:
        """A llama.cpp /completion or /infill body: one Prepared per prompt (params None: n_predict 0, nothing to
        generate). An /infill prompt is trimmed to leave room for n_predict tokens (INFILL_MIDDLE_SHARE of the context
        without one): the other files go first, then the prefix, then the suffix (model/fim.py infill_ids), as
        llama.cpp's server fits it."""
        req = parse(InfillRequest if infill else LlamaCompletionRequest, body)
        limits.check_request(req, vocab)
        asked = req.tokens_asked()
        if infill:
            need_fim("/infill")
            texts = (req.input_prefix, req.input_suffix, req.prompt, *(f.text for f in req.input_extra))
            size = sum(map(len, texts))
            if size > MAX_PROMPT_CHARS_PER_TOKEN * max_prompt * 4:
                raise bad_request(f"the infill body is far longer than the {max_prompt} tokens this server accepts",
                                  "input_extra")
            files = [(f.filename, f.text) for f in req.input_extra]
            middle = int(INFILL_MIDDLE_SHARE * llm.max_model_len) if asked is None else asked
            prompts = [tokenize(infill_ids(llm.tokenizer, fim, req.input_prefix, req.input_suffix, req.prompt, files,
                                           max_tokens=min(max_prompt, llm.max_model_len - middle)))]
        else:
            prompts = [tokenize(mixed_ids(p)) for p in req.prompts()]
            if len(prompts) > 1 and req.stream:
                raise bad_request("several prompts cannot be streamed; send one request per prompt", "prompt")
        if asked == 0:
            return [Prepared(req, ids, None) for ids in prompts]
        source, structured = req.structured()
        ready = []
        for ids in prompts:
            params = native_params(req, len(ids), asked, structured)
            # Both routes stop at the FIM end tokens too, as llama.cpp's end-of-generation set holds them.
            params = fim_params(params, fim) if fim is not None else params
            ready.append(Prepared(req, ids, params, grammar=compiled(params, source)))
        return ready

    def mixed_ids(prompt: str | list) -> str | list[int]:
        """A llama.cpp prompt: text, or token ids and texts mixed (each text tokenized, the first one with the
        tokenizer's BOS)."""
        if isinstance(prompt, str) or all(isinstance(v, int) for v in prompt):
            return prompt
        ids: list[int] = []
        for i, piece in enumerate(prompt):
            ids += llm.tokenizer.encode(piece, add_special_tokens=i == 0) if isinstance(piece, str) else [piece]
        return ids

    def compiled(params: SamplingParams, source: str | None) -> Grammar | None:
        if params.structured is None:
            return None
        try:
            return Grammar(params.structured, llm.tokenizer, vocab)
        except ConfigError as exc:
            raise bad_request(f"{source}: {exc}", source) from None

    def native_bias(req: LlamaCompletionRequest) -> dict[int, float] | None:
        """The request's logit_bias; with ignore_eos the end tokens banned too, as llama.cpp's ignore_eos does (at
        -100, the bias range's end, where llama.cpp's is -inf)."""
        bias = req.token_bias(llm.tokenizer, vocab)
        if req.ignore_eos:
            bias = {**(bias or {}), **{token: -100.0 for token in llm.tokenizer.eos_token_ids}}
        return bias

    def native_params(req: LlamaCompletionRequest, prompt_len: int, asked: int | None,
                      structured: dict | None) -> SamplingParams:
        room = llm.max_model_len - prompt_len
        if asked is not None and asked > room:
            raise bad_request(f"this model's context is {llm.max_model_len} tokens; the prompt has {prompt_len} "
                              f"and n_predict is {asked}: ask for at most {room} tokens", "n_predict")
        try:
            return SamplingParams(max_tokens=asked or room, temperature=max(0.0, req.temperature), top_k=req.top_k,
                                  top_p=req.top_p, min_p=req.min_p, presence_penalty=req.presence_penalty,
                                  frequency_penalty=req.frequency_penalty, stop=req.stop,
                                  seed=None if req.seed in (None, -1) else req.seed, ignore_eos=req.ignore_eos,
                                  use_speculation=req.use_speculation, logprobs=req.probs(),
                                  logit_bias=native_bias(req), structured=structured)
        except ConfigError as exc:
            field = str(exc).split(" ", 1)[0]
            raise bad_request(str(exc), field) from None

    def prepare_chat(body: bytes) -> Prepared:
        req = parse(ChatCompletionRequest, body)
        check(req)
        text, plan = render_chat(req)
        # A template that writes the BOS token itself must not get a second one from the tokenizer.
        bos = llm.tokenizer.bos_token
        ids = tokenize(text, add_special_tokens=not (bos and text.startswith(bos)))
        return prepared(req, ids, req.token_limit(), req.logprob_count(), plan=plan)

    def render_chat(req: ChatCompletionRequest) -> tuple[str, tools.ToolPlan | None]:
        """The prompt of a chat request (its chat template's rendering, with tools when offered); with
        continue_final_message it ends inside the last (assistant) message, as transformers cuts it."""
        limits.check_messages(req.messages)
        plan = tool_calling.plan(req)
        messages = [m.for_template() for m in req.messages]
        offered = {"tools": plan.tools} if plan is not None else {}
        opening = req.add_generation_prompt is not False and not req.continue_final_message
        try:
            text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=opening, **offered)
        except jinja2.TemplateError as exc:  # the template refused these messages (raise_exception) or was unsafe
            raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
        except Exception:
            log.exception("the chat template failed")
            raise bad_request("the chat template could not render these messages", "messages") from None
        if req.continue_final_message:
            final = req.messages[-1].text()
            end = text.rfind(final) if final else -1
            if end < 0:
                raise bad_request("the chat template does not write the last message as it is, so it cannot be "
                                  "continued", "continue_final_message")
            text = text[:end + len(final)]
        return text, plan

    def apply_template(body: bytes) -> dict:
        req = parse(ChatCompletionRequest, body)
        check(req)
        return {"prompt": render_chat(req)[0]}

    @app.post("/apply-template", **schema.generation_route(ChatCompletionRequest, schema.AppliedTemplate))
    async def apply_template_route(request: Request):
        """llama-server's: the prompt a chat request would be answered from (its template's rendering)."""
        return await run_in_threadpool(apply_template, await request.body())

    # -- routes ---------------------------------------------------------------------------------------------

    def submit(prepared: Prepared, request_id: str) -> list[RequestStream]:
        """One stream per choice (n of them; choice i > 0 with its own seed, choice_seed): queued together, so
        the engine can prefill their prompt once."""
        params, streams = prepared.params, []
        try:
            for i in range(params.n):
                choice = dataclasses.replace(params, n=1, seed=choice_seed(params.seed, i))
                grammar = prepared.grammar.copy() if prepared.grammar is not None else None
                streams.append(engine.add_request(prepared.ids, choice,
                                                  request_id if params.n == 1 else f"{request_id}-{i}", grammar))
            return streams
        except ConfigError as exc:
            raise bad_request(str(exc)) from None
        except EngineOverloaded as exc:
            raise APIError(503, str(exc), type="server_overloaded", code="queue_full") from None
        except EngineDead as exc:
            raise APIError(503, str(exc), type="server_error") from None
        finally:
            if len(streams) < params.n:  # a choice was refused: the others go too
                for stream in streams:
                    stream.abort()

    @app.post("/v1/completions", **schema.generation_route(CompletionRequest, schema.Completion))
    async def completions(request: Request):
        prepared = await run_in_threadpool(prepare_completion, await request.body())
        req, echo = prepared.req, prepared.echo
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = submit(prepared, request_id)
        offsets = [[len(echo)] for _ in streams]  # text_offset of each choice's next token

        def choice(index: int, text: str, finish_reason: str | None, logprobs: list | None) -> dict:
            return {"index": index, "text": text, "finish_reason": finish_reason,
                    "logprobs": None if req.logprobs is None else completion_logprobs(logprobs, offsets[index])}

        def chunk(choices: list[dict]) -> dict:
            return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model_name,
                    "system_fingerprint": fingerprint, "choices": choices}

        if req.stream:
            async def events() -> AsyncIterator[str]:
                if echo:
                    yield _sse(chunk([choice(i, echo, None, []) for i in range(len(streams))]))
                def delta_chunks(i: int, d) -> list[dict]:
                    if d.finish_reason is None or not d.text:
                        return [chunk([choice(i, d.text, d.finish_reason, d.logprobs)])]
                    # llama-server's last chunk only says why it ended (clients drop its text)
                    return [chunk([choice(i, d.text, None, d.logprobs)]), chunk([choice(i, "", d.finish_reason, [])])]
                async for body in _stream_chunks(streams, delta_chunks, _include_usage(req), request_id, model_name,
                                                 "text_completion", fingerprint):
                    yield body
            return _sse_response(events())
        results = await _collect_all(streams, request)
        body = chunk([choice(i, echo + text, finish, logprobs) for i, (text, finish, _, logprobs) in enumerate(results)])
        body["usage"] = _total_usage(results)
        body["timings"] = _timings(streams[0])
        return body

    @app.post("/v1/chat/completions", **schema.generation_route(ChatCompletionRequest, schema.ChatCompletion))
    async def chat_completions(request: Request):
        prepared = await run_in_threadpool(prepare_chat, await request.body())
        req, plan = prepared.req, prepared.tool_plan
        call_format = plan.format if plan is not None else None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = submit(prepared, request_id)

        def chunk(index: int, delta: dict, finish_reason: str | None, logprobs: list | None = None) -> dict:
            return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": model_name, "system_fingerprint": fingerprint,
                    "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason,
                                 "logprobs": chat_logprobs(logprobs) if req.logprobs else None}]}

        if req.stream:
            # With tools, each choice's text goes through its own parser: content as it comes (less what may begin
            # a call), each call whole, as one tool_calls delta, once its close tag arrives.
            parsers = [tools.ToolCallParser(call_format) for _ in streams] if call_format else None
            calls_made = [0] * len(streams)

            def delta_chunk(i: int, d) -> list[dict]:
                if parsers is None:
                    delta, finish = ({"content": d.text} if d.text else {}), d.finish_reason
                else:
                    content, calls = parsers[i].feed(d.text, final=d.finish_reason is not None)
                    delta = {"content": content} if content else {}
                    if calls:
                        delta["tool_calls"] = [call.openai(index=calls_made[i] + k) for k, call in enumerate(calls)]
                        calls_made[i] += len(calls)
                    if not delta and d.finish_reason is None and not d.logprobs:
                        return []  # everything in this delta is held back
                    finish = tools.finish_reason(d.finish_reason, calls_made[i])
                if finish is None or not delta:
                    return [chunk(i, delta, finish, d.logprobs)]
                # llama-server's last chunk only says why it ended: the text before it
                return [chunk(i, delta, None, d.logprobs), chunk(i, {}, finish, [])]

            async def events() -> AsyncIterator[str]:
                for i in range(len(streams)):
                    yield _sse(chunk(i, {"role": "assistant", "content": None}, None, []))
                async for body in _stream_chunks(streams, delta_chunk, _include_usage(req), request_id, model_name,
                                                 "chat.completion.chunk", fingerprint):
                    yield body
            return _sse_response(events())

        def message(text: str, finish: str | None) -> tuple[dict, str | None]:
            if call_format is None:
                return {"role": "assistant", "content": text}, finish
            content, calls = tools.parse(text, call_format)
            answer = {"role": "assistant", "content": content if content or not calls else None}
            if calls:
                answer["tool_calls"] = [call.openai() for call in calls]
            return answer, tools.finish_reason(finish, len(calls))

        results = await _collect_all(streams, request)
        choices = []
        for i, (text, finish, _, logprobs) in enumerate(results):
            answer, finish = message(text, finish)
            choices.append({"index": i, "message": answer, "finish_reason": finish,
                            "logprobs": chat_logprobs(logprobs) if req.logprobs else None})
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "system_fingerprint": fingerprint, "choices": choices, "usage": _total_usage(results),
                "timings": _timings(streams[0])}

    @app.post("/completion", **schema.generation_route(LlamaCompletionRequest, schema.LlamaCompletion))
    async def llama_completion(request: Request):
        """llama.cpp's own completion route (Continue's llama.cpp provider streams it, its FIM prompt in prompt)."""
        return await native(request, infill=False)

    @app.post("/infill", **schema.generation_route(InfillRequest, schema.LlamaCompletion))
    async def llama_infill(request: Request):
        """llama.cpp's fill-in-the-middle route, as llama.vscode calls it."""
        return await native(request, infill=True)

    async def native(request: Request, infill: bool):
        ready = await run_in_threadpool(prepare_native, await request.body(), infill)
        if len(ready) == 1:
            return await native_one(request, ready[0])
        answers = await asyncio.gather(*(native_one(request, prepared) for prepared in ready))
        return answers  # llama-server answers several prompts with a list, in their order

    async def native_one(request: Request, prepared: Prepared):
        req, ids, params = prepared.req, prepared.ids, prepared.params
        prompt_text = llm.tokenizer.decode(ids, skip_special_tokens=False)
        settings = llama_native.generation_settings(req, params, llm, model_name)
        if params is None:  # n_predict 0: nothing to generate (llama.vscode sends it to warm the cache)
            timing = llama_native.timings(len(ids), 0, 0, 0)
            body = llama_native.select(req.response_fields, llama_native.final(
                model_name, "", prompt_text, len(ids), 0, "limit", "", settings, timing))
            if req.stream:
                return _sse_response(_one_event(body))
            return body
        stream = submit(prepared, f"cmpl-{uuid.uuid4().hex}")[0]
        editor = llama_native.EditorLimits(req.n_indent or 0, req.t_max_predict_ms or 0)

        def finished(text: str, finish: str | None, probs: list | None) -> dict:
            seq = stream.seq
            stop_type, word = "limit", ""
            if finish == "stop":
                full = llm.tokenizer.decode(seq.output_ids)
                word = next((w for w in params.stop if full[len(seq.text):].startswith(w)), "")
                stop_type = "word" if word else "eos"
            tokens = list(seq.output_ids) if req.return_tokens and not req.stream else []
            return llama_native.select(req.response_fields, llama_native.final(
                model_name, text, prompt_text, len(ids), seq.num_generated, stop_type, word, settings,
                _timings(stream), probs, tokens))

        async def pieces() -> AsyncIterator[tuple[str, list, list, str | None]]:
            """(text, token ids, logprobs, finish reason) of each delta, the text ending where an editor's limit
            (n_indent, t_max_predict_ms) cuts it: then the request is aborted and its finish reason is "length"
            (llama.cpp's "limit")."""
            text = ""
            async for delta in stream:
                cut = editor.cut(text + delta.text, time.perf_counter() - (stream.first_token_time or 0), delta.text)
                if cut is not None:
                    stream.abort()
                    yield (text + delta.text)[len(text):cut], delta.token_ids, delta.logprobs or [], "length"
                    return
                text += delta.text
                yield delta.text, delta.token_ids, delta.logprobs or [], delta.finish_reason

        def probabilities(logprobs: list) -> list | None:
            return llama_native.probabilities(logprobs, llm.tokenizer) if logprobs else None

        if req.stream:
            per_token = llama_native.PerToken(llm.tokenizer) if params.logprobs is not None else None

            async def events() -> AsyncIterator[str]:
                generated = 0
                try:
                    async for text, tokens, logprobs, finish in pieces():
                        # with per-token data (n_probs) one event per token, as llama-server sends; else one per
                        # delta (a step's accepted draft comes whole)
                        split = per_token.split(text, tokens) if per_token is not None else [(text, tokens)]
                        for k, (piece, piece_tokens) in enumerate(split):
                            generated += len(piece_tokens)
                            if piece or piece_tokens:
                                probs = probabilities(logprobs[k:k + 1] if per_token is not None else logprobs)
                                yield _sse(llama_native.select(req.response_fields, llama_native.partial(
                                    piece, piece_tokens, generated, len(ids), probs)))
                        if finish is not None:
                            yield _sse(finished("", finish, None))
                except (RequestFailed, EngineDead) as exc:
                    yield _sse(APIError(500, str(exc), type="server_error").body())
                finally:
                    stream.abort()
            return _sse_response(events())

        async def collect() -> tuple[str, str | None, list]:
            parts, all_logprobs, finish = [], [], None
            async for text, _, logprobs, finish in pieces():
                parts.append(text)
                all_logprobs += logprobs
            return "".join(parts), finish, all_logprobs

        async with _watched(request, stream):
            text, finish, logprobs = await collect()
        return finished(text, finish, probabilities(logprobs))

    def token_text(token: int) -> str:
        return llm.tokenizer.decode([token])

    def completion_logprobs(logprobs: list | None, offset: list[int]) -> dict:
        """OpenAI's completions format: parallel lists; text_offset continues across a stream's chunks."""
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in logprobs or []:
            text = token_text(lp.token)
            body["tokens"].append(text)
            body["token_logprobs"].append(lp.logprob)
            body["top_logprobs"].append({token_text(t): v for t, v in lp.top})
            body["text_offset"].append(offset[0])
            offset[0] += len(text)
        return body

    def chat_logprobs(logprobs: list | None) -> dict:
        """OpenAI's chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
        def entry(token: int, logprob: float) -> dict:
            return {"token": token_text(token), "logprob": logprob, "bytes": list(llm.tokenizer.token_bytes(token))}
        return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs or []]}

    return app


def _include_usage(req) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens the prefix cache held (their keys and values were not computed)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _timings(stream: RequestStream) -> dict:
    """llama-server's timings of one request (its first choice's, for several)."""
    seq, now = stream.seq, time.perf_counter()
    first = stream.first_token_time or now
    last = stream.last_token_time or first
    return llama_native.timings(seq.num_prompt, first - stream.arrival, seq.num_generated, max(0.0, last - first),
                                seq.stats.draft_tokens, seq.stats.accepted_tokens, cached=seq.reused)


def _sse(body: dict) -> str:
    # ASCII only: generated text may hold U+2028, U+2029 or U+0085, which SSE does not treat as line ends but
    # splitlines-based clients (httpx's aiter_lines, for one) do, cutting an event in two.
    return f"data: {json.dumps(body)}\n\n"


async def _one_event(body: dict) -> AsyncIterator[str]:
    yield _sse(body)


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream_chunks(streams: list[RequestStream], make_chunks, include_usage: bool, request_id: str,
                         model_name: str, obj: str, fingerprint: str) -> AsyncIterator[str]:
    """SSE events for one request's choices, as each choice's deltas come (make_chunks(index, delta): the events of
    it, maybe none). If the client goes away, Starlette cancels this generator and `finally` aborts every
    choice, which frees their slots. Engine errors carry no internal detail (see RequestFailed)."""
    last: dict[int, object] = {}
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except (RequestFailed, EngineDead) as exc:
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, delta = await queue.get()
            if delta is None:
                running -= 1
            elif isinstance(delta, Exception):
                yield _sse(APIError(500, str(delta), type="server_error").body())
                return
            else:
                last[index] = delta
                if delta.text or delta.finish_reason is not None or delta.logprobs:
                    for body in make_chunks(index, delta):
                        yield _sse(body)
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()
    if include_usage and last:
        prompt = next(iter(last.values())).prompt_tokens
        completion = sum(d.completion_tokens for d in last.values())
        yield _sse({"id": request_id, "object": obj, "created": int(time.time()), "model": model_name,
                    "system_fingerprint": fingerprint, "choices": [],
                    "usage": _usage(prompt, completion, streams[0].seq.reused), "timings": _timings(streams[0])})
    yield "data: [DONE]\n\n"


async def _collect_all(streams: list[RequestStream], request: Request) -> list[tuple]:
    """_collect for each choice (they run side by side in the engine); if one fails, the others are aborted."""
    try:
        return list(await asyncio.gather(*(_collect(s, request) for s in streams)))
    finally:
        for stream in streams:
            stream.abort()


def _total_usage(results: list[tuple]) -> dict:
    """Usage of all choices: the prompt once, every choice's tokens."""
    usages = [usage for _, _, usage, _ in results]
    return _usage(usages[0]["prompt_tokens"], sum(u["completion_tokens"] for u in usages),
                  usages[0]["prompt_tokens_details"]["cached_tokens"])


async def _abort_on_disconnect(request: Request, stream: RequestStream) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.abort()


@contextlib.asynccontextmanager
async def _watched(request: Request, stream: RequestStream):
    """A non-streamed request's life: aborted if the client disconnects, the engine's failures as HTTP errors (499,
    500), the request released at the end whatever happened."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, stream))
    try:
        yield
    except RequestAborted:
        raise APIError(499, "the client closed the request") from None
    except (RequestFailed, EngineDead) as exc:
        raise APIError(500, str(exc), type="server_error") from None
    finally:
        watcher.cancel()
        stream.abort()


async def _collect(stream: RequestStream, request: Request) -> tuple[str, str | None, dict, list]:
    """Whole text, finish reason, usage and token logprobs (empty unless asked for) of a non-streaming request;
    aborts it if the client disconnects."""
    parts, logprobs, last = [], [], None
    async with _watched(request, stream):
        async for delta in stream:
            parts.append(delta.text)
            logprobs.extend(delta.logprobs or [])
            last = delta
    return ("".join(parts), last.finish_reason, _usage(last.prompt_tokens, last.completion_tokens, stream.seq.reused),
            logprobs)
