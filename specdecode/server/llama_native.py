"""The answers of llama.cpp's own server routes, /completion and /infill (tools/server/server-task.cpp), which code
editors parse: llama.vscode reads content, timings, tokens_cached and truncated of an /infill answer; Continue's
llama.cpp provider streams /completion and reads each event's content.

Streaming is server-sent events of partial answers ({"content", "stop": false, ...}), then the final answer with
"stop": true, its timings and an empty content; no "[DONE]" line (llama.cpp sends none on these routes).
"""
from __future__ import annotations

import dataclasses

STOP_TYPES = {"eos": "eos", "word": "word", "length": "limit"}
"""How the request ended -> llama.cpp's stop_type."""


@dataclasses.dataclass
class EditorLimits:
    """llama.cpp's two stops for code completion (server-context.cpp), which llama.vscode sends: a middle of several
    lines ends where a line is indented less than n_indent (kept up to that line's indentation), and once generating
    has taken t_max_predict_ms, at the next piece that holds a newline. 0: off."""

    n_indent: int = 0
    t_max_predict_ms: int = 0

    def cut(self, text: str, generating_s: float, piece: str) -> int | None:
        """How much of text (the answer so far, piece its newest part) to keep when it must end now; None: go on."""
        if self.n_indent > 0:
            start = text.find("\n") + 1
            while start > 0:  # each line that follows a newline, once something follows its indentation
                end = start
                while end < len(text) and text[end] in " \t":
                    end += 1
                if end < len(text) and end - start < self.n_indent:
                    return end
                start = text.find("\n", start) + 1
        if self.t_max_predict_ms > 0 and "\n" in piece and generating_s * 1000 > self.t_max_predict_ms:
            return len(text)
        return None


def timings(prompt_n: int, prompt_s: float, predicted_n: int, predicted_s: float, drafted: int = 0,
            accepted: int = 0, cached: int = 0) -> dict:
    """llama.cpp's timings object (its server_slot_stats), draft counters included when anything was drafted.
    prompt_n: the prompt's tokens, of which `cached` came from the prefix cache (cache_n; prompt_n counts the rest,
    as llama.cpp's). predicted_s runs from the first token to the last: the first comes from the prompt's pass, so the
    rates are over the predicted_n - 1 tokens after it (0 for one token)."""
    prompt_ms, predicted_ms = prompt_s * 1000, predicted_s * 1000
    computed, steps = prompt_n - cached, max(0, predicted_n - 1)
    body = {"cache_n": cached,
            "prompt_n": computed, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / computed if computed else 0.0,
            "prompt_per_second": computed / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps and predicted_s > 0 else 0.0,
            "predicted_per_second": steps / predicted_s if steps and predicted_s > 0 else 0.0}
    if drafted:
        body["draft_n"] = drafted
        body["draft_n_accepted"] = accepted
    return body


def probabilities(logprobs: list, tokenizer) -> list[dict]:
    """completion_probabilities: per token {id, token, bytes, logprob, top_logprobs: [{id, token, bytes, logprob}]}
    (log-probabilities: llama.cpp's form without post_sampling_probs)."""
    def entry(token: int, logprob: float) -> dict:
        return {"id": token, "token": tokenizer.decode([token]), "bytes": list(tokenizer.token_bytes(token)),
                "logprob": logprob}
    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]


class PerToken:
    """Splits a delta of several tokens (a step's accepted draft) into one piece per token, as llama-server streams
    when a request asks for per-token data: each token's text is where decoding the answer up to it ends, so the
    pieces do not depend on how the tokens were grouped into steps (speculation on or off)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""
        """Text of the pieces so far (the deltas' text, which is what the answer is)."""

    def split(self, text: str, tokens: list[int]) -> list[tuple[str, list[int]]]:
        received = self.sent + text
        pieces = []
        for k, token in enumerate(tokens):
            self.ids.append(token)
            upto = self.tokenizer.decode(self.ids).rstrip("\ufffd")  # a partial character waits for the rest
            end = len(received) if k == len(tokens) - 1 else max(len(self.sent), min(len(upto), len(received)))
            pieces.append((received[len(self.sent):end], [token]))
            self.sent = received[:end]
        if not tokens and text:
            pieces.append((text, []))
            self.sent = received
        return pieces


def generation_settings(req, params, llm, model_name: str) -> dict:
    """The settings a request ran with, in llama-server's generation_settings names (those without a counterpart
    here at llama.cpp's defaults, which a request cannot change: protocol.LLAMA_UNSUPPORTED)."""
    from specdecode.server.protocol import LLAMA_SAMPLERS, LLAMA_UNSUPPORTED

    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    bias = params.logit_bias if params is not None and params.logit_bias else {}
    fixed = {k: v for k, v in LLAMA_UNSUPPORTED.items() if k not in ("multimodal_data", "dry_sequence_breakers")}
    return {
        "n_predict": 0 if params is None else params.max_tokens, "max_tokens": 0 if params is None else
        params.max_tokens, "seed": -1 if req.seed is None else req.seed, "temperature": req.temperature,
        "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty, "stop": stop, "ignore_eos": req.ignore_eos, "stream": req.stream,
        "n_probs": req.probs() or 0, "logit_bias": [{"bias": value, "token": token} for token, value in bias.items()],
        "grammar": req.grammar or "", "samplers": req.sampler_names() if req.samplers is not None else
        [name for name in LLAMA_SAMPLERS if name not in ("typ_p",)], **fixed,
        "dry_sequence_breakers": LLAMA_UNSUPPORTED["dry_sequence_breakers"], "model": model_name,
        "speculative": llm.spec_config.method if llm.proposer is not None else None,
        "use_speculation": req.use_speculation,
        # llama.cpp's adaptive-p sampler, off at these values
        "adaptive_target": -1.0, "adaptive_decay": 0.9,
    }


def partial(text: str, tokens: list[int], predicted: int, prompt_n: int, probs: list[dict] | None = None) -> dict:
    """One streamed piece of the answer, with its token ids."""
    body = {"index": 0, "content": text, "tokens": tokens, "stop": False, "id_slot": -1,
            "tokens_predicted": predicted, "tokens_evaluated": prompt_n}
    if probs:
        body["completion_probabilities"] = probs
    return body


def final(model: str, text: str, prompt: str, prompt_n: int, predicted: int, stop_type: str, stopping_word: str,
          settings: dict, timing: dict, probs: list[dict] | None = None, tokens: list[int] | None = None) -> dict:
    """The whole answer (streaming: its last event, with text ""); tokens: the generated ids (return_tokens)."""
    body = {"index": 0, "content": text, "tokens": tokens or [], "id_slot": -1, "stop": True, "model": model,
            "tokens_predicted": predicted, "tokens_evaluated": prompt_n, "generation_settings": settings,
            "prompt": prompt, "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type,
            "stopping_word": stopping_word, "tokens_cached": prompt_n + max(0, predicted - 1), "timings": timing}
    if probs:
        body["completion_probabilities"] = probs
    return body


def select(fields: list[str] | None, body: dict) -> dict:
    """response_fields: only the fields named ("a/b" reaches into an object; the key stays "a/b"), as llama.cpp."""
    if not fields:
        return body
    out = {}
    for path in fields:
        value, found = body, True
        for key in path.split("/"):
            if isinstance(value, dict) and key in value:
                value = value[key]
            else:
                found = False
                break
        if found:
            out[path] = value
    return out
