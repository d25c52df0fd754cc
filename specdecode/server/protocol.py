"""OpenAI's request bodies (the fields specdecode honours), llama.cpp's own, and OpenAI's error format.

Bodies are validated strictly (no "0.5" for a number, no NaN) so that nothing malformed reaches the engine. Nothing a
/v1 body holds is silently ignored: a field is implemented, accepted only at its default (other servers' fields that
clients send anyway: LLAMA_UNSUPPORTED, V1_UNSUPPORTED), accepted as advice OpenAI itself may ignore (user,
metadata, ...), or refused with a 400 naming it.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from specdecode.errors import ConfigError
from specdecode.sampling import MAX_LOGPROBS, check_structured


def gbnf_grammar(text: str, field: str) -> dict:
    """SamplingParams.structured of llama.cpp's GBNF grammar (llguidance's converter to its Lark form; text already
    in that form passes), or a 400 naming the field."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return {"grammar": any_to_lark(text)}
    except Exception as exc:  # the converter raises its own errors and Python's for broken input
        raise bad_request(f"{field} is not a valid GBNF grammar: {exc}", field) from None


def _integral(value):
    """JSON has one number type: 5.0 is the integer 5 (as JSON Schema's "integer" says); 5.5 stays an error."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2 ** 64:
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]


def _until_the_end(value):
    """llama-server's -1 (generate until an end token or the context is full: llama.vscode's chat edit sends it on
    /v1/chat/completions) read as an absent limit; any other value as it is."""
    return None if value == -1 and not isinstance(value, bool) else value


Limit = Annotated[int | None, BeforeValidator(_until_the_end), BeforeValidator(_integral)]
"""max_tokens of the /v1 routes: a positive integer, null, or llama-server's -1 for no limit."""
"""An integer field: 5 or 5.0, never 5.5, "5" or true."""


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, **extra):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.extra = extra
        """More fields of the error object (llama-server's n_prompt_tokens and n_ctx)."""

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


MAX_LOGIT_BIAS = 300
"""Most tokens one logit_bias may name (OpenAI's limit)."""


LLAMA_UNSUPPORTED = {
    "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "typical_p": 1.0, "xtc_probability": 0.0,
    "xtc_threshold": 0.1, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
    "top_n_sigma": -1.0, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "repeat_penalty": 1.0, "repeat_last_n": 64,
    "penalty_last_n": 64, "min_keep": 0, "n_keep": 0, "n_discard": 0, "post_sampling_probs": False,
    "return_progress": False, "timings_per_token": False, "id_slot": -1, "lora": [], "grammar_lazy": False,
    "grammar_triggers": [], "preserved_tokens": [], "n_cmpl": 1, "backend_sampling": False,
    "dry_sequence_breakers": ["\n", ":", "\"", "*"], "n_cache_reuse": 0, "multimodal_data": None,
}
"""llama.cpp's /completion fields specdecode does not implement, with llama.cpp's defaults: a body may send one at
its default (clients send whole settings objects), anything else is a 400 naming it, on llama.cpp's routes and on
/v1 alike. cache_prompt, t_max_prompt_ms and samplers are taken as LlamaServerFields says."""
LLAMA_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "typical_p", "top_p", "min_p", "xtc",
                  "temperature")
SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                   "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill"}
"""llama.cpp's letters for its samplers: samplers may be a string of them ("edkypmxt", llama.vscode's chat edit)."""

V1_UNSUPPORTED = {
    # OpenAI's
    "prediction": None, "audio": None, "modalities": ["text"], "reasoning_effort": None, "web_search_options": None,
    "verbosity": "medium",
    # vLLM's
    "use_beam_search": False, "length_penalty": 1.0, "min_tokens": 0, "include_stop_str_in_output": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "prompt_logprobs": None,
    "allowed_token_ids": None, "bad_words": [], "truncate_prompt_tokens": None, "priority": 0, "echo": False,
    "chat_template": None, "chat_template_kwargs": {}, "documents": None, "cache_salt": None,
    # llama-server's, which /completion and /infill implement but a /v1 answer has no place for
    "n_probs": 0, "return_tokens": False, "n_indent": 0, "t_max_predict_ms": -1, "response_fields": [],
}
"""Fields OpenAI, vLLM or llama-server define that the /v1 routes do not implement, with their defaults: accepted at
the default or null, a 400 naming the field otherwise. Beside LLAMA_UNSUPPORTED's, the only fields a /v1 body may
hold that its model does not declare (echo: the chat route's, vLLM's; the completions route implements its own)."""


def unsupported(field: str, default, whose: str = "its") -> APIError:
    """The 400 of a field this server takes only at its default."""
    advice = "leave it out" if default is None else f"leave it out or at {whose} default {json.dumps(default)}"
    return bad_request(f"{field} is not supported by this server; {advice}", field)


class _Body(BaseModel):
    """A /v1 request body or a part of one: a field its model does not declare is a 400 naming it
    (refuse_undeclared), but for those of defaults_only at their default or null."""

    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"additionalProperties": False})
    defaults_only: ClassVar[dict[str, Any]] = {}
    """Other servers' fields this model accepts only at these values, where they change nothing."""


def refuse_undeclared(body: _Body, where: str = "") -> None:
    """A 400 naming the first field of body, or of a part of it, that its model neither declares nor takes at that
    value (defaults_only); where: the body's place in the request ("messages.2.")."""
    for name, value in (body.model_extra or {}).items():
        field = where + name
        if name not in body.defaults_only:
            raise bad_request(f"{field} is not a field this server knows; leave it out (docs/serving.md lists the "
                              "fields /v1 takes)", field)
        if value is not None and value != body.defaults_only[name]:
            raise unsupported(field, body.defaults_only[name], "llama.cpp's" if name in LLAMA_UNSUPPORTED else "its")
    for name in type(body).model_fields:
        value = getattr(body, name)
        parts = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, part in parts:
            if isinstance(part, _Body):
                refuse_undeclared(part, f"{where}{name}." + ("" if i is None else f"{i}."))


class LlamaServerFields(BaseModel):
    """llama-server's fields that its clients send to /v1 as well as to its own routes, taken alike by both."""

    model_config = ConfigDict(strict=True, extra="allow")
    cache_prompt: bool = True
    """Accepted either way: whether a prompt's beginning comes from the prefix cache never changes an answer here."""
    t_max_prompt_ms: Int | None = None
    """Accepted, no effect (llama-server does not implement it either; llama.vscode sends it)."""
    samplers: list[str] | str | None = None
    """llama.cpp's sampler chain, as names or letters (SAMPLER_LETTERS): accepted when it holds implemented samplers
    in llama.cpp's default order, and llama.vscode's "infill" (not applied: docs/serving.md)."""

    def sampler_names(self) -> list[str] | None:
        """samplers as names (letters spelled out); None when absent."""
        if isinstance(self.samplers, str):
            return [SAMPLER_LETTERS.get(letter, letter) for letter in self.samplers]
        return self.samplers

    def check_samplers(self) -> None:
        names = [name for name in self.sampler_names() or [] if name != "infill"]
        if any(name not in LLAMA_SAMPLERS for name in names) or names != sorted(names, key=LLAMA_SAMPLERS.index):
            raise bad_request("samplers must list llama.cpp's samplers in its default order (penalties, dry, "
                              "top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature); others are not "
                              "supported", "samplers")


class StreamOptions(_Body):
    defaults_only: ClassVar[dict[str, Any]] = {"continuous_usage_stats": False}  # vLLM's: usage in every chunk
    include_usage: bool = False
    include_obfuscation: bool | None = None
    """OpenAI's random padding of stream chunks against length side channels: accepted, never added here."""


class _Request(_Body, LlamaServerFields):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"additionalProperties": False})
    defaults_only: ClassVar[dict[str, Any]] = {**LLAMA_UNSUPPORTED, **V1_UNSUPPORTED}
    limit_fields: ClassVar[tuple[str, ...]] = ("max_tokens",)
    """The route's fields for the most tokens to generate (the first that is not null counts)."""
    # null is accepted wherever OpenAI's default applies
    model: str | None = None
    temperature: float | None = Field(None, allow_inf_nan=False)
    top_p: float | None = Field(None, allow_inf_nan=False)
    top_k: Int | None = None
    min_p: float | None = Field(None, allow_inf_nan=False)
    """vLLM's extension: SamplingParams.min_p."""
    n: Int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    n_predict: Limit = None
    """llama-server's name for max_tokens (-1: until the end); beside max_tokens only at the same value."""
    stop_token_ids: list[Int] | None = None
    """vLLM's extension: tokens that end the answer as the end-of-sequence token does (SamplingParams')."""
    ignore_eos: bool = False
    """specdecode extension: keep generating after an end-of-sequence token."""
    use_speculation: bool = True
    """specdecode extension: false decodes this request without speculation."""
    sampler: Literal["auto", "race", "rejection"] = "auto"
    """specdecode extension: SamplingParams.sampler (auto: the exponential race when seeded, so a seed gives one
    text with or without speculation)."""
    repetition_penalty: float | None = Field(None, allow_inf_nan=False)
    """vLLM's extension: SamplingParams.repetition_penalty."""
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    grammar: str | None = None
    """llama-server's: a GBNF grammar the answer follows."""
    json_schema: dict[str, Any] | None = None
    """llama-server's: a JSON schema the answer follows."""
    # OpenAI's advice about a request, which changes no answer: accepted, no effect here (docs/serving.md).
    user: str | None = None
    """OpenAI's id of the end user (for its abuse monitoring)."""
    safety_identifier: str | None = None
    """OpenAI's successor of user."""
    metadata: dict[str, Any] | None = None
    """OpenAI's tags of a stored completion (nothing is stored here)."""
    store: bool | None = None
    """OpenAI's: keep the completion for its dashboard (nothing is stored here)."""
    service_tier: str | None = None
    """OpenAI's processing tier ("auto", "default", "flex", "priority"): every request is served alike here."""
    prompt_cache_key: str | None = None
    """OpenAI's hint for routing to its prompt cache (the prefix cache here finds shared beginnings itself)."""

    def structured(self) -> tuple[str | None, dict | None]:
        """(field, SamplingParams.structured) from response_format (OpenAI) or vLLM's guided_* /
        structured_outputs; at most one of them, or a 400 naming the field. (None, None) without one."""
        found = []
        rf = self.response_format
        if rf is not None and rf != {"type": "text"}:
            kind = rf.get("type") if isinstance(rf, dict) else None
            if kind == "json_object":  # llama-server's form carries a schema
                schema = rf.get("schema")
                if schema is not None and not isinstance(schema, dict):
                    raise bad_request("response_format.schema must be a JSON schema object", "response_format")
                found.append(("response_format", {"json_schema": schema} if schema else {"json_object": True}))
            elif kind == "json_schema" and isinstance(rf.get("json_schema"), dict):
                schema = rf["json_schema"].get("schema")
                found.append(("response_format", {"json_schema": schema} if isinstance(schema, dict) and schema
                              else {"json_object": True}))
            else:
                raise bad_request("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                  "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                                  "response_format")
        guided = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
        for name, kind in guided.items():
            value = getattr(self, name)
            if value is not None:
                if kind == "json_schema" and isinstance(value, str):
                    try:
                        value = json.loads(value)
                    except json.JSONDecodeError:
                        raise bad_request(f"{name} must be a JSON schema", name) from None
                found.append((name, {kind: value}))
        if self.grammar:
            found.append(("grammar", gbnf_grammar(self.grammar, "grammar")))
        if self.json_schema is not None:
            found.append(("json_schema", {"json_schema": self.json_schema} if self.json_schema
                          else {"json_object": True}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            keys = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
            picked = [(keys[k], v) for k, v in so.items() if k in keys and v is not None] if isinstance(so, dict) else []
            if len(picked) != 1:
                raise bad_request("structured_outputs must hold exactly one of json, regex, choice, grammar",
                                  "structured_outputs")
            found.append(("structured_outputs", dict(picked)))
        return the_one_structured(found)

    def check_supported(self) -> None:
        refuse_undeclared(self)
        self.check_samplers()
        if self.n_predict is not None and self.n_predict < 1:
            raise bad_request("n_predict must be -1 (until an end token) or a positive number of tokens", "n_predict")
        self.token_limit()
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens", "logit_bias")

    def token_limit(self) -> int | None:
        """The most tokens to generate (None: until the end): llama-server's n_predict when the body gives it, else
        the first of limit_fields that is not null, else the last one's default. n_predict beside one of them at
        another value is a 400."""
        names = self.limit_fields
        if "n_predict" not in self.model_fields_set:
            return next((getattr(self, n) for n in names if getattr(self, n) is not None), getattr(self, names[-1]))
        for name in names:
            if name in self.model_fields_set and getattr(self, name) not in (None, self.n_predict):
                raise bad_request(f"n_predict and {name} ask for different lengths; send one of them", "n_predict")
        return self.n_predict

    def token_bias(self, vocab: int) -> dict[int, float] | None:
        """logit_bias with its keys as token ids; a key that is not a token id of this model is a 400 (the values'
        range is SamplingParams')."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isascii() or not key.isdigit() or int(key) >= vocab:
                raise bad_request(f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias")
            bias[int(key)] = value
        return bias


class CompletionRequest(_Request):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Limit = 16
    echo: bool | None = False
    logprobs: Int | None = None
    best_of: Int | None = None
    suffix: str | None = None
    """Fill in the middle: the text after the insertion point, the prompt being the text before it (models whose
    vocabulary has FIM tokens; model/fim.py). "" or null: a plain completion."""

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
        if self.logprobs is not None and self.echo:
            raise bad_request("echo with logprobs (the prompt's log-probabilities) is not supported; drop one of "
                              "them", "echo")
        if self.best_of not in (None, 1):
            raise bad_request("best_of is not supported", "best_of")

    def single_prompt(self) -> str | list[int]:
        """The prompt as text or token ids (a list holding one prompt is accepted too)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("only one prompt per request is supported; send one request per prompt",
                                  "prompt")
            prompt = prompt[0]
        return prompt


class ExtraFile(BaseModel):
    """One entry of /infill's input_extra: another file of the project, as context."""

    model_config = ConfigDict(strict=True, extra="ignore")
    text: str
    filename: str = "tmp"
    """llama.cpp's default name."""


def _llama_prompt(value):
    """{"prompt_string": ...} (llama.cpp's multimodal prompt object, without media) -> its text."""
    if isinstance(value, dict):
        if value.get("multimodal_data"):
            raise ValueError("multimodal_data is not supported (this server has no vision or audio model)")
        if not isinstance(value.get("prompt_string"), str):
            raise ValueError("a prompt object must hold prompt_string")
        return value["prompt_string"]
    if isinstance(value, list) and value and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [_llama_prompt(v) if isinstance(v, dict) else v for v in value]
    return value


class LlamaCompletionRequest(LlamaServerFields):
    """llama.cpp's server's own /completion body (what its clients send, Continue's llama.cpp provider among them):
    the fields specdecode honours, with llama.cpp's defaults; LLAMA_UNSUPPORTED's only at their defaults. Fields
    llama.cpp does not define are ignored, as llama.cpp ignores them."""

    model_config = ConfigDict(strict=True, extra="allow")
    prompt: Annotated[str | list[Int | str | list[Int | str]], BeforeValidator(_llama_prompt)] = ""
    """Text, token ids, ids and text mixed (one prompt), or a list of such prompts (one answer each)."""
    n_predict: Int | None = None
    """Most tokens to generate; -1 or absent: until an end token or the context is full; 0: none (a client warming
    the cache)."""
    max_tokens: Int | None = None
    """Alias of n_predict (used when n_predict is absent)."""
    temperature: float = Field(0.8, allow_inf_nan=False)
    top_k: Int = 40
    top_p: float = Field(0.95, allow_inf_nan=False)
    min_p: float = Field(0.05, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    stream: bool = False
    stop: list[str] | str | None = None
    seed: Int | None = Field(None, ge=-1, lt=2 ** 64)
    """-1 or absent: a fresh seed."""
    n_probs: Int | None = None
    """The most likely tokens to report at each position (completion_probabilities); alias logprobs."""
    logprobs: Int | None = None
    ignore_eos: bool = False
    response_fields: list[str] | None = None
    """Only these fields of the answer ("timings/predicted_n" reaches into an object), as llama.cpp."""
    use_speculation: bool = True
    """specdecode extension: false decodes this request without speculation."""
    n_indent: Int | None = Field(None, ge=-1)
    """A line after the first indented less than this ends the answer (llama.cpp's; llama.vscode sends it)."""
    t_max_predict_ms: Int | None = None
    """After this many ms of generating, the next newline ends the answer (llama.cpp's; llama.vscode sends it)."""
    return_tokens: bool = False
    """The generated token ids in the answer's tokens (streamed events always carry theirs)."""
    logit_bias: list[list[Any]] | dict[str, Any] | None = None
    """[[token id or text, bias or false], ...] or {"token id or text": bias}: text biases each of its tokens; false
    bans the token (bias -100)."""
    grammar: str | None = None
    """A GBNF grammar the answer follows (the same constrained decoding as /v1's)."""
    json_schema: dict[str, Any] | None = None
    """A JSON schema the answer follows."""
    response_format: Any = None
    """OpenAI's form of the same: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}."""

    def structured(self) -> tuple[str | None, dict | None]:
        """(field, SamplingParams.structured) from grammar, json_schema or response_format: at most one of them."""
        found = []
        if self.grammar:
            found.append(("grammar", gbnf_grammar(self.grammar, "grammar")))
        if self.json_schema is not None:
            found.append(("json_schema", {"json_schema": self.json_schema} if self.json_schema
                          else {"json_object": True}))
        if self.response_format is not None and self.response_format != {"type": "text"}:
            rf = self.response_format
            kind = rf.get("type") if isinstance(rf, dict) else None
            schema = rf.get("schema") if kind == "json_object" else \
                (rf.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
            if kind not in ("json_object", "json_schema"):
                raise bad_request("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                  "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {...}}}",
                                  "response_format")
            found.append(("response_format", {"json_schema": schema} if schema else {"json_object": True}))
        return the_one_structured(found)

    def token_bias(self, tokenizer, vocab: int) -> dict[int, float] | None:
        """logit_bias as {token id: bias}: a text's every token; false -> -100 (never picked)."""
        if not self.logit_bias:
            return None
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        bias = {}
        for pair in pairs:
            if len(pair) != 2:
                raise bad_request("logit_bias entries must be [token id or text, bias or false]", "logit_bias")
            key, value = pair
            if value is False:
                value = -100.0
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise bad_request(f"logit_bias values must be numbers in [-100, 100] or false, got {value!r}",
                                  "logit_bias")
            if isinstance(key, str) and key.isascii() and key.isdigit():
                key = int(key)
            if isinstance(key, int) and not isinstance(key, bool):
                if not 0 <= key < vocab:
                    raise bad_request(f"logit_bias token ids must be in [0, {vocab}), got {key}", "logit_bias")
                ids = [key]
            elif isinstance(key, str):
                ids = tokenizer.encode(key, add_special_tokens=False)
            else:
                raise bad_request(f"logit_bias keys must be token ids or text, got {key!r}", "logit_bias")
            for token in ids:
                bias[token] = float(value)
        if len(bias) > MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
        return bias or None

    def prompts(self) -> list[str | list[int | str]]:
        """The prompts of this body: one, or each of a list of prompts (a list holding a list, or only texts)."""
        p = self.prompt
        if isinstance(p, list) and p and (any(isinstance(v, list) for v in p) or all(isinstance(v, str) for v in p)):
            return [v for v in p]
        return [p]

    def check_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in LLAMA_UNSUPPORTED and value != LLAMA_UNSUPPORTED[name]:
                raise unsupported(name, LLAMA_UNSUPPORTED[name], "llama.cpp's")
        self.check_samplers()

    def tokens_asked(self) -> int | None:
        """n_predict (else max_tokens); None for "until the end" (-1 or absent)."""
        n = self.n_predict if self.n_predict is not None else self.max_tokens
        if n is not None and n < -1:
            raise bad_request("n_predict must be -1 (until an end token), 0 or a positive number of tokens",
                              "n_predict")
        return None if n is None or n == -1 else n

    def probs(self) -> int | None:
        n = self.n_probs if self.n_probs is not None else self.logprobs
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise bad_request(f"n_probs must be in [0, {MAX_LOGPROBS}]", "n_probs")
        return n or None

    def check_supported(self) -> None:
        self.tokens_asked()
        self.probs()
        self.check_unsupported()
        self.structured()


class InfillRequest(LlamaCompletionRequest):
    """llama.cpp's /infill body (llama.vscode sends it): the code before and after the cursor, other files of the
    project, and the text typed so far on the cursor's line (prompt)."""

    input_prefix: str
    input_suffix: str
    input_extra: list[ExtraFile] = []
    prompt: str = ""


class TextPart(_Body):
    type: Literal["text"]
    text: str


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
"""What OpenAI allows as a function's name (it is also written unescaped into tool-call grammars)."""


class FunctionDefinition(_Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; None: the function takes no arguments."""
    strict: bool | None = None
    """OpenAI's: the arguments follow the schema exactly. They do whenever the output is constrained (tool_choice
    "required" or a named function); with "auto" the model writes them freely, as in vLLM."""


class Tool(_Body):
    """One entry of a chat request's `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(_Body):
    name: str
    arguments: str
    """The arguments as a JSON string, as OpenAI sends them back."""


class MessageToolCall(_Body):
    """A call an earlier assistant message made (so that the template can show it to the model)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: Int | None = None
    """A streamed call's place in its message (clients that rebuild calls from the deltas send it back): no effect,
    the list's order is the calls' order."""


class ChatMessage(_Body):
    defaults_only: ClassVar[dict[str, Any]] = {"refusal": None, "audio": None, "function_call": None,
                                               "annotations": []}
    """OpenAI's fields of an answer's message (a client may send the message back as it came), empty."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    """An assistant message's calls."""
    tool_call_id: str | None = None
    """A tool message's answer is to this call."""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it (transformers' convention): a call's arguments as an object,
        where OpenAI sends a JSON string (a template writes them with tojson)."""
        message = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name,
                                                   "arguments": _json_or_text(call.function.arguments)}}
                                     for call in self.tool_calls]
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        return message


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ChatCompletionRequest(_Request):
    limit_fields: ClassVar[tuple[str, ...]] = ("max_completion_tokens", "max_tokens")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Limit = None
    max_completion_tokens: Limit = None
    logprobs: bool | None = False
    top_logprobs: Int | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None
    """"none", "auto", "required" or {"type": "function", "function": {"name": ...}} (checked by tool_mode)."""
    parallel_tool_calls: bool | None = None
    """OpenAI's (default true): whether the model may call several functions in one answer."""
    functions: Any = None
    function_call: Any = None
    add_generation_prompt: bool | None = None
    """Open an assistant turn after the messages (default true)."""
    continue_final_message: bool = False
    """Continue the last message, an assistant's, instead of opening a new turn (vLLM's and transformers' name)."""

    def check_supported(self) -> None:
        super().check_supported()
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                                  "continue_final_message")
            if self.messages[-1].role != "assistant":
                raise bad_request("continue_final_message needs the last message to be the assistant's",
                                  "continue_final_message")
        if len(self.messages) >= 2 and self.messages[-1].role == self.messages[-2].role == "assistant":
            raise bad_request("the conversation ends with two assistant messages; merge them (or send "
                              "continue_final_message with one)", "messages")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name} (OpenAI's deprecated form) is not supported; send tools and tool_choice",
                                  name)
        self.tool_mode()

    def tool_mode(self) -> tuple[str, str | None]:
        """(mode, function) from tools and tool_choice, OpenAI's defaults included: ("none", None) without tools,
        else "auto" unless tool_choice says "none", "required" or ("function", its name); a 400 naming the field for
        anything else."""
        if self.tools:
            names = [tool.function.name for tool in self.tools]
            for i, name in enumerate(names):
                if name in names[:i]:
                    raise bad_request(f"tools offers the function {name!r} twice", f"tools.{i}.function.name")
        choice = self.tool_choice
        if choice is None:
            return ("auto" if self.tools else "none"), None
        if choice == "none":
            return "none", None
        if not self.tools:
            raise bad_request("tool_choice other than \"none\" needs tools", "tool_choice")
        if choice in ("auto", "required"):
            return choice, None
        function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise bad_request("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}", "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which tools does not offer", "tool_choice")
        return "function", name

    def logprob_count(self) -> int | None:
        """SamplingParams.logprobs for this request: None without logprobs, else top_logprobs (default 0)."""
        return (self.top_logprobs or 0) if self.logprobs else None


def parse(model: type[BaseModel], body: bytes):
    """Validate a JSON body; any problem becomes a 400 naming the offending field."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise bad_request(f"the request body is not valid JSON: {first['msg']}") from None
        param = ".".join(str(p) for p in first["loc"]) or None
        where = f"{param}: " if param else ""
        raise bad_request(f"{where}{first['msg']}", param) from None
    request.check_supported()
    return request


def the_one_structured(found: list[tuple[str, dict]]) -> tuple[str | None, dict | None]:
    """(field name, spec) of the one structured-output field a request gave, checked; (None, None) for none; a 400
    naming the second when it gave several, or naming the field whose spec is invalid."""
    if len(found) > 1:
        raise bad_request(f"give one of {', '.join(n for n, _ in found)}, not several", found[1][0])
    if not found:
        return None, None
    name, spec = found[0]
    try:
        check_structured(spec)
    except ConfigError as exc:
        raise bad_request(str(exc), name) from None
    return name, spec
