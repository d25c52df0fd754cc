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
            accepted: int = 0) -> dict:
    """llama.cpp's timings object (its server_slot_stats), draft counters included when anything was drafted."""
    prompt_ms, predicted_ms = prompt_s * 1000, predicted_s * 1000
    body = {"cache_n": 0,
            "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": predicted_n / predicted_s if predicted_s > 0 else 0.0}
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


def partial(text: str, predicted: int, prompt_n: int, probs: list[dict] | None = None) -> dict:
    """One streamed piece of the answer."""
    body = {"index": 0, "content": text, "tokens": [], "stop": False, "id_slot": -1, "tokens_predicted": predicted,
            "tokens_evaluated": prompt_n}
    if probs:
        body["completion_probabilities"] = probs
    return body


def final(model: str, text: str, prompt: str, prompt_n: int, predicted: int, stop_type: str, stopping_word: str,
          settings: dict, timing: dict, probs: list[dict] | None = None) -> dict:
    """The whole answer (streaming: its last event, with text "")."""
    body = {"index": 0, "content": text, "tokens": [], "id_slot": -1, "stop": True, "model": model,
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
